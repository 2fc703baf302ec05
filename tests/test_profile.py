"""Device profile storage, the scratch file, the cost model fit and plans, `flashllm profile`."""
import json
import os

import numpy as np
import pytest
from typer.testing import CliRunner

from flashllm.storage.costmodel import CostModel, bundle_requests, fit_points
from flashllm.storage.profile import (Cell, Profile, ProfileError, device_of, load_profile, measure,
                                     profile_path, save_profile, scratch_file)
from flashllm.units import GiB, KiB, MiB, PAGE, SizeError, parse_size

CHUNKS = [4 * KiB << i for i in range(9)]


def synthetic_points(a, bandwidth, threads):
    """(chunk, threads, GiB/s) of a device whose read takes exactly a + chunk / bandwidth."""
    return [(c, threads, c / (a + c / bandwidth) / GiB) for c in CHUNKS]


def test_fit_recovers_overhead_and_bandwidth():
    fit = fit_points(16, [(c, g) for c, _, g in synthetic_points(8e-6, 2.5 * GiB, 16)])
    assert fit.overhead == pytest.approx(8e-6, rel=1e-6)
    assert fit.bandwidth == pytest.approx(2.5 * GiB, rel=1e-6)
    assert fit.merge_gap == int(8e-6 * 2.5 * GiB) // PAGE * PAGE  # 20 KiB: a hole costs a/B


def model_two_pools():
    return CostModel.from_points(synthetic_points(100e-6, 1.5 * GiB, 1) +
                                 synthetic_points(5e-6, 2.0 * GiB, 16), "test")


def test_plan_merges_holes_below_the_gap_and_picks_the_fast_pool():
    model = model_two_pools()
    stride = 1536
    ids = np.arange(0, 4000, 2)  # (2000,) every other neuron: 1.5 KiB holes
    offsets, lengths = bundle_requests(4096, stride, ids)  # (2000,) (2000,)
    plan = model.plan(offsets, lengths)
    assert plan.threads == 16 and plan.max_gap == int(5e-6 * 2 * GiB) // PAGE * PAGE
    pages = -(-(offsets[-1] + stride) // PAGE) - 1  # every page from 4096 to the last bundle's
    assert plan.bytes_read == pages * PAGE and plan.gap_bytes == 0  # 1.5 KiB holes share pages
    assert plan.max_run == -(-(offsets[-1] + stride - offsets[0]) // 64) // PAGE * PAGE
    assert plan.reads == -(-pages * PAGE // plan.max_run)  # joined runs, one or more per thread
    assert plan.bytes_requested == 2000 * stride
    avg = plan.bytes_read / plan.reads  # the device's GiB/s there, log-interpolated by hand:
    chunks, gib = zip(*[(c, g) for c, _, g in synthetic_points(5e-6, 2.0 * GiB, 16)])
    by_hand = plan.bytes_read / (np.interp(np.log2(avg), np.log2(chunks), gib) * GiB)
    assert plan.seconds == pytest.approx(by_hand)
    one = model.plan(offsets, lengths, threads=[1])
    assert one.threads == 1 and one.seconds > plan.seconds


def test_a_dip_at_more_threads_is_lifted_and_the_deepest_near_tie_wins():
    noisy = synthetic_points(20e-6, 2.5 * GiB, 4) + [(c, 8, g * 0.8) for c, _, g in
                                                      synthetic_points(20e-6, 2.5 * GiB, 8)]
    model = CostModel.from_points(noisy, "test")
    assert model.gib_s(8, 64 * KiB) == pytest.approx(model.gib_s(4, 64 * KiB))  # not 0.8×
    ids = np.arange(0, 40000, 2)  # (20000,) 61 MB: 1 MiB reads for either pool
    assert model.plan(*bundle_requests(4096, 1536, ids)).threads == 8
    small = model.plan(*bundle_requests(4096, 1536, np.arange(0, 4000, 2)))  # 6 MB
    assert small.threads == 4  # 8 would cut it into reads of half the size: > 10% slower


def test_best_threads_is_the_fewest_within_five_percent():
    model = CostModel.from_points(synthetic_points(20e-6, 2 * GiB, 4) + synthetic_points(
        19.5e-6, 2 * GiB, 8) + synthetic_points(5e-6, 2 * GiB, 16), "test")
    assert model.best_threads(4 * KiB) == 16
    assert model.best_threads(1 << 20) == 4  # large reads: every pool streams at 2 GiB/s


def test_cost_model_without_profile_uses_defaults_and_hints(tmp_path):
    model = CostModel.for_path(tmp_path / "cache", tmp_path)
    assert model.source == "built-in defaults"
    assert "run `flashllm profile" in model.hint
    assert set(model.fits) == {1, 4, 16}


def fake_profile(tmp_path):
    cells = [Cell("random", c, t, g, g * GiB / c, 100, 0.1)
             for c, t, g in synthetic_points(10e-6, 2 * GiB, 8)]
    return Profile(device_of(tmp_path), True, 1 << 30, "2025-01-01T00:00:00", cells)


def test_profile_is_saved_per_device_and_read_back(tmp_path):
    profile = fake_profile(tmp_path)
    dev = os.stat(tmp_path).st_dev
    assert (profile.device.major, profile.device.minor) == (os.major(dev), os.minor(dev))
    path = save_profile(profile, tmp_path / "cache")
    assert path == profile_path(tmp_path / "cache", profile.device) and path.is_file()
    assert load_profile(tmp_path / "cache", profile.device) == profile
    model = CostModel.for_path(tmp_path / "cache", tmp_path)
    assert model.source.startswith("profile of") and model.hint is None
    assert model.fits[8].overhead == pytest.approx(10e-6, rel=1e-6)
    path.write_text("{not json")
    with pytest.raises(ProfileError, match="unreadable.*run `flashllm profile` again"):
        load_profile(tmp_path / "cache", profile.device)


def test_parse_size():
    assert parse_size("2GiB") == 2 * GiB and parse_size("512MiB") == 512 * MiB
    assert parse_size("1.5G") == 3 * GiB // 2 and parse_size("4096") == 4096
    with pytest.raises(SizeError, match="cannot read 'lots' as a size"):
        parse_size("lots")


def test_scratch_file_is_removed_even_on_ctrl_c(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        with scratch_file(tmp_path, 3 * MiB) as path:
            assert path.stat().st_size == 3 * MiB
            raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []


def test_measure_counts_what_it_read(tmp_path):
    with scratch_file(tmp_path, 8 * MiB) as path:
        profile = measure(path, 0.2, chunks=[4 * KiB, 64 * KiB], threads=[1, 4])
    assert [(c.kind, c.chunk, c.threads) for c in profile.cells] == [
        ("seq", MiB, 1), ("random", 4 * KiB, 1), ("random", 64 * KiB, 1),
        ("seq", MiB, 4), ("random", 4 * KiB, 4), ("random", 64 * KiB, 4)]
    for c in profile.cells:
        assert c.reads > 0 and c.gib_s == pytest.approx(c.reads * c.chunk / c.seconds / GiB)


def test_cli_profile_on_a_scratch_folder(tmp_path):
    from flashllm.cli import app
    cache = tmp_path / "cache"
    work = tmp_path / "work"
    work.mkdir()
    result = CliRunner().invoke(app, ["profile", str(work), "--size", "8MiB", "--seconds", "1",
                                      "--json"], env={"FLASHLLM_CACHE": str(cache)})
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout[result.stdout.index("{"):result.stdout.rindex("}") + 1])
    assert len(data["cells"]) == 2 + 9 * 6
    assert list(work.iterdir()) == []
    assert profile_path(cache, device_of(work)).is_file()
