"""The storage device: its measured read profile, the read-plan cost model fitted to it, and the
read-ahead that keeps it busy (a C thread reading a fixed schedule ahead of the forward pass)."""
