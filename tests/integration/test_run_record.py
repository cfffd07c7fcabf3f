"""The record each bench writes beside its figures names its output by file, not by the folders of
the machine that ran it, and keeps every other argument as given."""

from __future__ import annotations

import shlex

from bench.common import run_record


def test_the_command_names_output_files_without_their_folders() -> None:
    record = run_record(["--json", "/srv/run/out/conv-tiles.json", "--buckets", "64x4", "-o", "rel/x.json"])
    words = shlex.split(record["command"])
    assert words[:2] == ["python", "-m"]
    assert words[3:] == ["--json", "conv-tiles.json", "--buckets", "64x4", "-o", "rel/x.json"]
    assert "/srv" not in record["command"]
