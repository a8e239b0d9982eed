"""Tests for the GPU catalog and device lookup."""

from __future__ import annotations

import dataclasses

import pytest

from batchfit.errors import ConfigError, UnknownNameError
from batchfit.gpu.catalog import (
    CONTEXT_BYTES,
    CPU,
    NOTE,
    Device,
    _build_index,
    catalog,
    get_device,
)

REQUIRED = {
    "V100-16GB",
    "V100-32GB",
    "T4",
    "A10G",
    "L4",
    "L40S",
    "RTX-3090",
    "RTX-4090",
    "A6000",
    "A100-40GB",
    "A100-80GB",
    "H100-80GB",
    "H200",
    "B200",
}

# Marketed size in GB, to catch a total entered in the wrong unit: the driver-reported total sits
# between 90% of the decimal figure and the binary (GiB) figure.
NOMINAL_GB = {
    "V100-16GB": 16,
    "V100-32GB": 32,
    "T4": 16,
    "A10G": 24,
    "L4": 24,
    "L40S": 48,
    "RTX-3090": 24,
    "RTX-4090": 24,
    "A6000": 48,
    "A100-40GB": 40,
    "A100-80GB": 80,
    "H100-80GB": 80,
    "H200": 141,
    "B200": 192,
}


def test_catalog_has_at_least_the_fourteen_gpus():
    names = [d.name for d in catalog()]
    assert len(names) >= 14
    assert REQUIRED <= set(names)
    assert len(names) == len(set(names))
    assert all(d.kind == "cuda" for d in catalog())


def test_catalog_is_ordered_by_total_memory_then_name_and_is_a_fresh_list():
    devices = catalog()
    keys = [(d.total_bytes, d.name) for d in devices]
    assert keys == sorted(keys)
    assert devices[0].name == "T4"
    assert devices[-1].name == "B200"
    devices.clear()
    assert len(catalog()) >= 14


@pytest.mark.parametrize("name", sorted(NOMINAL_GB))
def test_totals_are_in_bytes_and_plausible(name):
    device = get_device(name)
    nominal = NOMINAL_GB[name]
    assert 0.9 * nominal * 10**9 <= device.total_bytes <= nominal * 2**30


def test_every_name_resolves_to_itself():
    for device in catalog():
        assert get_device(device.name) == device
        assert get_device(device.name).name == device.name


def test_every_alias_resolves_to_its_device():
    aliases = [(alias, d.name) for d in catalog() for alias in d.aliases]
    assert len(aliases) >= 14
    for alias, name in aliases:
        assert get_device(alias).name == name, alias


@pytest.mark.parametrize(
    ("spec", "name"),
    [
        ("a100-40gb", "A100-40GB"),
        ("A100_40GB", "A100-40GB"),
        ("a100 40GB", "A100-40GB"),
        ("h100", "H100-80GB"),
        ("rtx3090", "RTX-3090"),
        ("rtx_4090", "RTX-4090"),
        ("NVIDIA H100 80GB HBM3", "H100-80GB"),
        ("nvidia a100-sxm4-80gb", "A100-80GB"),
        ("Tesla T4", "T4"),
        ("rtx a6000", "A6000"),
        ("  CPU ", "cpu"),
    ],
)
def test_lookup_ignores_case_dashes_underscores_and_spaces(spec, name):
    assert get_device(spec).name == name


def test_a_device_is_returned_as_is():
    custom = dataclasses.replace(get_device("T4"), name="my-t4", context_bytes=123)
    assert get_device(custom) is custom


def test_an_alias_claimed_by_two_devices_is_refused():
    one = dataclasses.replace(get_device("A100-40GB"), aliases=("a100",))
    two = dataclasses.replace(get_device("A100-80GB"), aliases=("A100",))
    with pytest.raises(ValueError, match="A100"):
        _build_index((one, two))


def test_bf16_is_false_exactly_for_volta_and_turing():
    for device in catalog():
        assert device.bf16 is (device.arch not in {"Volta", "Turing"}), device.name
    assert {d.arch for d in catalog() if not d.bf16} == {"Volta", "Turing"}


def test_cublas_workspace_follows_pytorch_default_by_compute_capability():
    seen_before, seen_from = False, False
    for device in catalog():
        if device.compute_capability < (9, 0):
            assert device.cublas_workspace_bytes == 8519680, device.name
            seen_before = True
        else:
            assert device.cublas_workspace_bytes == 32 * 2**20, device.name
            seen_from = True
        assert device.cublas_handles == 2
    assert seen_before and seen_from


@pytest.mark.parametrize(
    ("name", "arch", "cc"),
    [
        ("V100-32GB", "Volta", (7, 0)),
        ("T4", "Turing", (7, 5)),
        ("A10G", "Ampere", (8, 6)),
        ("A100-80GB", "Ampere", (8, 0)),
        ("L4", "Ada", (8, 9)),
        ("RTX-4090", "Ada", (8, 9)),
        ("H100-80GB", "Hopper", (9, 0)),
        ("B200", "Blackwell", (10, 0)),
    ],
)
def test_architecture_and_compute_capability(name, arch, cc):
    device = get_device(name)
    assert (device.arch, device.compute_capability) == (arch, cc)
    assert device.context_bytes == CONTEXT_BYTES[arch]


def test_context_defaults_are_in_the_lazy_loading_range():
    for device in catalog():
        assert 256 * 2**20 <= device.context_bytes < 2**30, device.name
        assert device.memory_bandwidth_gbps > 0 and device.bf16_tflops > 0, device.name


def test_usable_bytes_is_total_minus_context():
    for device in catalog():
        assert device.usable_bytes == device.total_bytes - device.context_bytes
    a100 = get_device("A100-40GB")
    assert a100.usable_bytes == 42298834944 - CONTEXT_BYTES["Ampere"]


@pytest.mark.parametrize(
    ("spec", "total"),
    [("24GiB", 24 * 2**30), ("16GB", 16 * 10**9), ("80 GiB", 80 * 2**30), ("512 mib", 512 * 2**20)],
)
def test_a_capacity_gives_a_generic_modern_cuda_device(spec, total):
    device = get_device(spec)
    assert device.total_bytes == total
    assert device.name == spec
    assert device.kind == "cuda" and not device.exact
    assert device.arch == "Ampere" and device.compute_capability == (8, 0) and device.bf16
    assert device.context_bytes == CONTEXT_BYTES["Ampere"]
    assert device.cublas_workspace_bytes == 8519680
    assert device.usable_bytes == total - CONTEXT_BYTES["Ampere"]


def test_cpu_is_exact_and_unlimited():
    cpu = get_device("cpu")
    assert cpu is CPU
    assert cpu.exact
    assert cpu.kind == "cpu"
    assert cpu.total_bytes is None and cpu.usable_bytes is None
    assert cpu.context_bytes == 0 and cpu.cublas_workspace_bytes == 0
    assert not any(d.exact for d in catalog())


def test_unknown_name_raises_a_one_line_error_with_a_close_match():
    with pytest.raises(UnknownNameError) as info:
        get_device("A100-45GB")
    message = str(info.value)
    assert "\n" not in message
    assert "'A100-40GB'" in message
    assert "batchfit gpus" in message
    assert "A100-40GB" in info.value.close_matches


def test_a_bare_number_is_a_model_number_not_bytes():
    with pytest.raises(UnknownNameError) as info:
        get_device("5090")
    assert "24GiB" in str(info.value)


@pytest.mark.parametrize("spec", ["0GiB", "abc GiB", "24XB", "-3GB", "1.5.2 GB"])
def test_unreadable_capacity_is_a_config_error_not_an_unknown_name(spec):
    with pytest.raises(ConfigError) as info:
        get_device(spec)
    assert not isinstance(info.value, UnknownNameError)
    assert "\n" not in str(info.value)


def test_a_capacity_smaller_than_the_context_is_refused():
    with pytest.raises(ConfigError, match="context"):
        get_device("256MiB")


def _changed_fields(before: Device, after: Device) -> set[str]:
    return {f.name for f in dataclasses.fields(Device) if getattr(before, f.name) != getattr(after, f.name)}


def test_with_overrides_changes_only_the_field_given():
    base = get_device("L4")
    ctx = base.with_overrides(context_bytes=700 * 2**20)
    assert _changed_fields(base, ctx) == {"context_bytes", "context_source", "context_detail"}
    assert (ctx.context_bytes, ctx.context_source, ctx.context_detail) == (700 * 2**20, "override", "--context-mib")
    assert ctx.usable_bytes == base.total_bytes - 700 * 2**20
    total = base.with_overrides(total_bytes=20 * 2**30)
    assert _changed_fields(base, total) == {"total_bytes"}
    assert total.usable_bytes == 20 * 2**30 - base.context_bytes
    assert _changed_fields(base, base.with_overrides()) == set()
    assert get_device("L4") == base


@pytest.mark.parametrize(
    ("spec", "kwargs"),
    [
        ("T4", {"context_bytes": -1}),
        ("T4", {"total_bytes": 0}),
        ("T4", {"context_bytes": 16 * 2**30}),
        ("cpu", {"context_bytes": 2**20}),
    ],
)
def test_with_overrides_rejects_impossible_values(spec, kwargs):
    with pytest.raises(ConfigError):
        get_device(spec).with_overrides(**kwargs)


def test_note_explains_eager_loading_and_the_override():
    assert "1343 MiB" in NOTE
    assert "--context-mib" in NOTE
    assert "11.7" in NOTE
