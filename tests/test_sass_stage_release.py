"""The SASS of every kernel in the built extension: no mbarrier arrive (a ring stage's release
among them) while a shared-memory load issued before it by the same thread may still be in
flight, unless a MEMBAR (a proxy fence's) comes between them. The arrive waits on no scoreboard,
so the producer's TMA refill of a stage can land before such a load reads it: releases without
the fence (ad3a29b) made 19 of 400 decode calls at one shape wrong or NaN (benchmarks/RESULTS.md,
fortieth session), and no CPU test saw it. Reads the SASS with the cuobjdump that triton ships;
needs the built extension, not a GPU.

An instruction's second 64-bit word holds its control bits from bit 41 on: the stall count (4
bits), the yield bit, the scoreboard it sets when its result lands (3 bits, 7: none), the one it
sets when its operands are read (3 bits) and the scoreboards it waits on (6 bits). Shared loads
(LDS, LDSM) complete in order, so ptxas gives some none and covers them by a later one's: a load
is in flight from its issue until an instruction waits on its own scoreboard or on that of a
shared load issued after it. The scan is conservative and simple: linear per function (control
flow not followed), any MEMBAR drains every load, and it cannot tell stages apart, so an arrive
that releases another stage than the one being read also counts (the register-A loop releases
the previous stage while loading the current one: a proxy fence before it keeps the scan, and
the PTX ISA, satisfied)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

INSTRUCTION = re.compile(r"/\*([0-9a-f]+)\*/\s+(.*?)\s*;\s*/\* (0x[0-9a-f]+) \*/")
CONTROL_WORD = re.compile(r"^\s*/\* (0x[0-9a-f]+) \*/\s*$")
FUNCTION = re.compile(r"Function : (\S+)")
# LDS, LDS.64, LDSM.16.M88.4, ..., unless predicated off for good (@!PT: padding)
SHARED_LOAD = re.compile(r"^(?!@!PT\b)(@!?U?P\w+\s+)?LDS")
NO_SCOREBOARD = 7


def cuobjdump() -> Path | None:
    try:
        import triton
    except ImportError:
        return None
    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return path if path.exists() else None


def releases_in_flight(sass: str) -> list[tuple[str, int, list[int]]]:
    """(function, address of the arrive, addresses of the shared loads still in flight) for
    every SYNCS.ARRIVE that a shared load issued before it in the same function may overtake."""
    found = []
    function = None
    in_flight: dict[int, list[int]] = {}  # scoreboard -> addresses of the loads it covers
    uncovered: list[int] = []  # loads with no scoreboard and none set after them yet
    lines = sass.splitlines()
    for i, line in enumerate(lines):
        name = FUNCTION.search(line)
        if name:
            function, in_flight, uncovered = name.group(1), {}, []
            continue
        instruction = INSTRUCTION.search(line)
        if not instruction or function is None or i + 1 >= len(lines):
            continue
        control_word = CONTROL_WORD.match(lines[i + 1])
        if not control_word:
            continue
        address, text = int(instruction.group(1), 16), instruction.group(2)
        control = int(control_word.group(1), 16) >> 41
        write_scoreboard, waits = (control >> 5) & 7, (control >> 11) & 0x3F
        for scoreboard in [s for s in in_flight if waits >> s & 1]:
            del in_flight[scoreboard]
        if "MEMBAR" in text:
            in_flight, uncovered = {}, []
        if "SYNCS.ARRIVE" in text and (in_flight or uncovered):
            loads = [a for covered in in_flight.values() for a in covered] + uncovered
            found.append((function, address, sorted(loads)))
        if SHARED_LOAD.match(text):
            if write_scoreboard == NO_SCOREBOARD:
                uncovered.append(address)
            else:
                in_flight[write_scoreboard] = (
                    in_flight.get(write_scoreboard, []) + uncovered + [address]
                )
                uncovered = []
    return found


def control(write_scoreboard: int = NO_SCOREBOARD, waits: int = 0) -> str:
    """A second instruction word carrying these control bits (stall 1, read scoreboard none)."""
    bits = 1 | write_scoreboard << 5 | NO_SCOREBOARD << 8 | waits << 11
    return f"{' ' * 100}/* 0x{bits << 41:016x} */"


def snippet(*instructions: tuple[str, str]) -> str:
    lines = ["\t\tFunction : kernel"]
    for n, (text, word) in enumerate(instructions):
        lines += [f"        /*{16 * n:04x}*/    {text} ;    /* 0x0000000000000000 */", word]
    return "\n".join(lines)


def test_scan_flags_an_arrive_ahead_of_a_load():
    load = ("LDS.64 R10, [R65+0x23a0]", control(write_scoreboard=0))
    arrive = ("SYNCS.ARRIVE.TRANS64.A1T0 RZ, [R79+URZ], RZ", control())
    use = ("FFMA R8, R10, R44, R17", control(waits=0b1))
    fence = ("MEMBAR.ALL.CTA", control())
    assert releases_in_flight(snippet(load, arrive, use)) == [("kernel", 0x10, [0x0])]
    assert releases_in_flight(snippet(load, use, arrive)) == []
    assert releases_in_flight(snippet(load, fence, arrive, use)) == []
    # A load without a scoreboard is covered by the next one's (shared loads land in order).
    bare = ("LDS.64 R14, [R65+0x23c0]", control())
    assert releases_in_flight(snippet(bare, arrive)) == [("kernel", 0x10, [0x0])]
    assert releases_in_flight(snippet(bare, load, arrive, use)) == [("kernel", 0x20, [0x0, 0x10])]
    assert releases_in_flight(snippet(bare, load, use, arrive)) == []
    assert releases_in_flight(snippet(("@!PT LDS RZ, [RZ]", control()), arrive)) == []


def test_no_stage_release_overtakes_a_shared_load():
    from prime_kernels import _extension_file

    tool, built = cuobjdump(), _extension_file("flash_moe")
    if tool is None or built is None:
        pytest.skip("needs the built extension and triton's cuobjdump")
    sass = subprocess.run(
        [str(tool), "-sass", str(built)], capture_output=True, text=True, check=True
    ).stdout
    assert "SYNCS.ARRIVE" in sass, "no mbarrier arrive in the SASS: the scan reads nothing"
    found = releases_in_flight(sass)
    assert not found, (
        "arrives that shared loads may overtake (function, arrive, loads): "
        + "; ".join(
            f"{function} at 0x{address:x}: {', '.join(hex(a) for a in loads)}"
            for function, address, loads in found[:5]
        )
    )
