"""The flash model folder on disk (docs/FORMAT.md): its layout rules, the atomic writer, the
validating reader and the first-load checksum check."""
