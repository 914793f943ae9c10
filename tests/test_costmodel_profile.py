"""HardwareProfile JSON, presets, and the errors a bad profile gets."""

import json
import math

import pytest

from autopar.costmodels import (
    POINTWISE_KINDS,
    CollectiveFit,
    HardwareProfile,
    ProfileError,
    Rate,
    a100,
    check_profile,
    h100,
    load_profile,
    preset,
)
from autopar.costmodels.presets import axis_links


def test_json_round_trip_is_exact(tmp_path):
    p = h100((2, 4, 8), axis_names=("pp", "dp", "tp"))
    q = HardwareProfile.from_json(p.to_json())
    assert q == p and q.to_json() == p.to_json()
    p.save(tmp_path / "p.json")
    assert HardwareProfile.load(tmp_path / "p.json") == p


def test_in_step_fits_round_trip(tmp_path):
    p = h100((2, 4), axis_names=("dp", "tp"))
    p.axes[1].in_step = {c: CollectiveFit(alpha_s=1e-4, beta_bytes_per_s=2e9, source="after compute")
                         for c in p.axes[1].collectives}
    q = HardwareProfile.from_json(p.to_json())
    assert q == p and q.axes[1].in_step["all_to_all"].beta_bytes_per_s == 2e9 and q.axes[0].in_step == {}


def test_a_size_one_axis_writes_strict_json_and_round_trips(tmp_path):
    # a measured profile gives an axis of size 1 an infinite bandwidth (nothing moves)
    p = h100((1, 4), axis_names=("pp", "tp"))
    for fit in p.axes[0].collectives.values():
        fit.alpha_s, fit.beta_bytes_per_s, fit.source = 0.0, math.inf, "axis of size 1"
    text = p.to_json()

    def no_constants(name):
        raise AssertionError(f"not strict JSON: {name}")

    d = json.loads(text, parse_constant=no_constants)
    assert d["axes"][0]["collectives"]["all_reduce"]["beta_bytes_per_s"] is None
    q = HardwareProfile.from_json(text)
    assert q == p and q.to_json() == text
    assert q.axes[0].collectives["all_gather"].beta_bytes_per_s == math.inf
    p.save(tmp_path / "p.json")
    assert HardwareProfile.load(tmp_path / "p.json") == p


def test_measured_points_round_trip_and_are_checked():
    p = h100((2,))
    p.device.pointwise["gelu"]["fp32"] = Rate(latency_s=1e-6, rate=5e9, points=[[4e6, 1e-3], [4e4, 2e-5]])
    q = HardwareProfile.from_json(p.to_json())
    assert q == p and q.device.pointwise["gelu"]["fp32"].points == [[4e4, 2e-5], [4e6, 1e-3]]  # sorted
    with pytest.raises(ProfileError, match="positive amounts and times"):
        Rate(latency_s=0.0, rate=1.0, points=[[1.0, -1.0]])


def test_gpu_presets_price_every_pointwise_kind_at_one_achievable_bandwidth_below_peak():
    for dev in (h100((8,)).device, a100((8,)).device):
        assert set(dev.pointwise) == set(POINTWISE_KINDS)
        achieved = {r.rate for kind in dev.pointwise.values() for r in kind.values()}
        assert len(achieved) == 1
        assert 0.8 * dev.peak_memory_bandwidth <= achieved.pop() < dev.peak_memory_bandwidth


@pytest.mark.parametrize(
    "shape, links",
    [
        ((8,), ["intra_node"]),
        ((16,), ["inter_node"]),
        ((2, 8), ["inter_node", "intra_node"]),
        ((4, 4), ["inter_node", "intra_node"]),
        ((2, 2, 2), ["intra_node"] * 3),
        ((4, 2, 4), ["inter_node", "intra_node", "intra_node"]),
        ((8, 1, 8), ["inter_node", "intra_node", "intra_node"]),
    ],
)
def test_inner_axes_ride_nvlink_while_they_fit_in_a_node(shape, links):
    assert axis_links(shape, 8) == links
    assert [a.link for a in h100(shape).axes] == links


def test_preset_numbers_and_sources():
    p = h100((8,))
    ar = p.fit("all_reduce", 0)
    assert 360e9 <= ar.beta_bytes_per_s <= 480e9  # nccl-tests: ring ~370, NVLS up to ~480
    assert ar.alpha_s == pytest.approx(8.4e-6 + 2 * 7 * 3.4e-6)  # NCCL ring/simple model
    assert p.fit("all_gather", 0).alpha_s == pytest.approx(8.4e-6 + 7 * 3.4e-6)
    assert "NCCL" in ar.source and "nccl-tests" in ar.source
    assert p.device.peak_matmul_flops["bf16"] == 989.5e12
    assert p.device.matmul["bf16"].rate == 794.5e12  # MAMF, ml-engineering
    # one 400 Gb/s NDR NIC per group: nccl-tests 46-48 GB/s
    assert 46e9 <= h100((2, 8)).fit("all_reduce", 0).beta_bytes_per_s <= 48e9
    assert 230e9 <= a100((8,)).fit("all_reduce", 0).beta_bytes_per_s <= 250e9
    assert 20e9 <= a100((2, 8)).fit("all_reduce", 0).beta_bytes_per_s <= 25e9  # 200 Gb/s HDR


def test_h100_is_faster_than_a100():
    h, a = h100((2, 8)), a100((2, 8))
    assert h.device.matmul["bf16"].rate > a.device.matmul["bf16"].rate
    for axis in (0, 1):
        assert h.fit("all_reduce", axis).beta_bytes_per_s > a.fit("all_reduce", axis).beta_bytes_per_s


def test_preset_lookup():
    assert preset("H100", (4,)) == h100((4,))
    assert preset("a100", (2, 2), ("dp", "tp")).axis("tp").size == 2
    with pytest.raises(ValueError, match="autopar: no hardware preset named 'tpu'; known presets"):
        preset("tpu", (4,))
    with pytest.raises(ValueError, match="autopar: a mesh shape"):
        preset("h100", (0, 2))
    with pytest.raises(ValueError, match="one name per axis"):
        h100((2, 2), ("dp",))


def test_axis_lookup_errors():
    p = h100((2, 2), ("dp", "tp"))
    assert p.axis("tp") is p.axes[1]
    with pytest.raises(ProfileError, match="autopar: no mesh axis named 'pp'"):
        p.axis("pp")
    with pytest.raises(ProfileError, match="out of range"):
        p.axis(2)


def test_missing_file(tmp_path):
    with pytest.raises(ProfileError, match="autopar: expected a hardware profile at .*found nothing"):
        HardwareProfile.load(tmp_path / "none.json")


@pytest.mark.parametrize(
    "text, match",
    [
        ("{not json", "must be JSON"),
        ("[1, 2]", "must be a JSON object"),
        ('{"version": 4}', "must hold machine"),
        ('{"version": 99}', "format version 99"),
        ('{"version": 1, "machine": "m"}', "format version 1; this autopar reads version 4"),
    ],
)
def test_corrupt_profiles_are_clear_errors(tmp_path, text, match):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ProfileError, match=f"autopar: .*{match}"):
        HardwareProfile.load(path)


def test_inconsistent_profiles_are_rejected():
    d = json.loads(h100((2, 4)).to_json())
    d["mesh_shape"] = [4, 2]
    with pytest.raises(ProfileError, match="axes have sizes"):
        HardwareProfile.from_dict(d)
    d = json.loads(h100((2,)).to_json())
    d["axes"][0]["collectives"].pop("all_to_all")
    with pytest.raises(ProfileError, match="no fit for \\['all_to_all'\\]"):
        HardwareProfile.from_dict(d)
    d = json.loads(h100((2,)).to_json())
    d["axes"][0]["collectives"]["all_reduce"]["beta_bytes_per_s"] = -1
    with pytest.raises(ProfileError, match="beta > 0"):
        HardwareProfile.from_dict(d)
    d = json.loads(h100((2,)).to_json())
    d["device"]["pointwise"].pop("gelu")
    with pytest.raises(ProfileError, match="no pointwise rates for \\['gelu'\\]"):
        HardwareProfile.from_dict(d)
    d = json.loads(h100((2,)).to_json())
    d["device"]["attention"]["backward"].pop("fp16")
    with pytest.raises(ProfileError, match="no attention backward rate for \\['fp16'\\]"):
        HardwareProfile.from_dict(d)
    d = json.loads(h100((2,)).to_json())
    d["axes"][0]["in_step"] = {"broadcast": d["axes"][0]["collectives"]["all_reduce"]}
    with pytest.raises(ProfileError, match="in-step fits for unknown collectives \\['broadcast'\\]"):
        HardwareProfile.from_dict(d)


def test_mismatched_profile_names_every_difference(tmp_path):
    p = h100((2, 4), ("dp", "tp"))
    p.save(tmp_path / "p.json")
    with pytest.raises(ProfileError) as e:
        load_profile(
            tmp_path / "p.json", machine="other", backend="nccl", mesh_shape=(4, 2), axis_names=("a", "b")
        )
    msg = str(e.value)
    assert msg.startswith("autopar: ")
    for part in ("machine 'preset:h100'", "backend 'preset'", "mesh (2, 4)", "axis names"):
        assert part in msg
    check_profile(p, mesh_shape=(2, 4))  # matching: no error
    with pytest.raises(ProfileError, match="made for mesh \\(2, 4\\), but the plan uses mesh \\(8,\\)"):
        p.check_mesh((8,))


def test_attention_points_per_head_round_trip():
    p = h100((2,))
    assert p.device.attention["forward"]["fp32"].points == []  # presets: one rate for every head
    p.device.attention["backward"]["fp32"] = Rate(latency_s=1e-5, rate=7e10, points=[[1.6e7, 2.4e-4], [2e6, 4e-5]])
    q = HardwareProfile.from_json(p.to_json())
    assert q == p and q.device.attention["backward"]["fp32"].points == [[2e6, 4e-5], [1.6e7, 2.4e-4]]
