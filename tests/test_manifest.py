"""kernels.toml validation: every malformed entry is an error naming the kernel and key."""

from __future__ import annotations

import pytest

from prime_kernels import _manifest
from prime_kernels._manifest import ManifestError, parse_manifest

VALID = """
[demo]
description = "a demo kernel"
ops = "prime_demo"
sources = ["csrc/demo.cu"]
include-dirs = ["csrc"]
arch = ["9.0a", "10.0f", "8.0"]
cxx-std = 17
"""


def test_repository_manifest_parses():
    specs = _manifest.load_manifest()
    assert list(specs)[0] == "flash_moe"
    flash_moe = specs["flash_moe"]
    assert flash_moe.ops == "prime_moe"
    assert flash_moe.arch == ("9.0a",)
    assert flash_moe.sm_names == ("sm_90a",)


def test_valid_table():
    spec = parse_manifest(VALID)["demo"]
    assert spec.compiled and spec.sources == ("csrc/demo.cu",)
    assert spec.sm_names == ("sm_90a", "sm_100f", "sm_80")
    assert _manifest.arch_to_gencode("9.0a") == "-gencode=arch=compute_90a,code=sm_90a"


def test_manifest_order_is_kept():
    text = VALID + VALID.replace("[demo]", "[alpha]").replace("prime_demo", "prime_alpha")
    assert list(parse_manifest(text)) == ["demo", "alpha"]


@pytest.mark.parametrize(
    ("edit", "key", "message"),
    [
        (("cxx-std = 17", 'cxx-std = 17\ncolour = "red"'), "colour", "unknown key"),
        (('arch = ["9.0a", "10.0f", "8.0"]', 'arch = ["sm_90a"]'), "arch", "not a compute"),
        (('arch = ["9.0a", "10.0f", "8.0"]', 'arch = ["9.0x"]'), "arch", "not a compute"),
        (('arch = ["9.0a", "10.0f", "8.0"]', "arch = []"), "arch", "at least one"),
        (('description = "a demo kernel"', 'description = "  "'), "description", "missing"),
        (('description = "a demo kernel"\n', ""), "description", "missing"),
        (('sources = ["csrc/demo.cu"]', 'sources = ["../other/x.cu"]'), "sources", "outside"),
        (('sources = ["csrc/demo.cu"]', 'sources = ["/abs/x.cu"]'), "sources", "outside"),
        (('include-dirs = ["csrc"]', 'include-dirs = ["../../x"]'), "include-dirs", "outside"),
        (('sources = ["csrc/demo.cu"]\n', ""), "sources", "missing"),
        (("cxx-std = 17", "cxx-std = 14"), "cxx-std", "not one of"),
        (("cxx-std = 17", 'cxx-std = "17"'), "cxx-std", "type int"),
        (('ops = "prime_demo"', 'ops = "prime-demo"'), "ops", "namespace"),
    ],
)
def test_invalid_entries_name_kernel_and_key(edit, key, message):
    old, new = edit
    assert old in VALID
    with pytest.raises(ManifestError) as error:
        parse_manifest(VALID.replace(old, new))
    text = str(error.value)
    assert "[demo]" in text and f"'{key}'" in text and message in text, text


def test_python_only_rules():
    ok = parse_manifest('[py]\ndescription = "pure"\npython-only = true\nrequires = ["triton"]\n')
    assert ok["py"].python_only and ok["py"].requires == ("triton",)
    with pytest.raises(ManifestError, match=r"\[py\] key 'sources'"):
        parse_manifest('[py]\ndescription = "x"\npython-only = true\nsources = ["a.cu"]\n')
    with pytest.raises(ManifestError, match=r"\[demo\] key 'requires'"):
        parse_manifest(VALID + 'requires = ["triton"]\n')


def test_duplicate_namespace_is_an_error():
    text = VALID + VALID.replace("[demo]", "[other]")
    with pytest.raises(ManifestError, match=r"\[other\] key 'ops'.*already registered by \[demo\]"):
        parse_manifest(text)


def test_bad_toml():
    with pytest.raises(ManifestError, match="not valid TOML"):
        parse_manifest("[demo\n")
