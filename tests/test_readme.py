"""The README's options table is generated from the config's field docs; keep them in sync.
docs/SPEC.md is the repository's copy of the team's contract; keep it equal to the source."""

from pathlib import Path

import pytest

from rlcore.options import options_table

ROOT = Path(__file__).parent.parent


def test_readme_options_table_matches_the_config():
    """Row by row, so a failure shows the row that differs; `rlcore options` prints the table."""
    want = options_table().strip().splitlines()
    lines = (ROOT / "README.md").read_text().splitlines()
    start = lines.index(want[0])  # the table's header row
    got = lines[start:start + len(want)]
    for row_want, row_got in zip(want, got):
        assert row_got == row_want, f"README.md's options table differs; paste `rlcore options` over it:\n" \
                                    f"README: {row_got}\nconfig: {row_want}"
    assert len(got) == len(want) and (len(lines) == start + len(want) or not lines[start + len(want)].startswith("|"))


def test_docs_spec_is_the_shared_contract_where_that_is_checked_out():
    source = ROOT.parent / "shared" / "SPEC.md"
    if not source.is_file():
        pytest.skip(f"{source} is not here to compare with (only the team's workspace has it)")
    assert (ROOT / "docs" / "SPEC.md").read_text() == source.read_text(), f"copy {source} to docs/SPEC.md"


def test_readme_tour_steps_are_train_py_numbered_comments_in_order():
    """The tour's "1. **Rollout.**" .. "6. **Metrics**" are train.py's "# 1. Rollout" .. "# 6. Metrics"."""
    import re

    readme = (ROOT / "README.md").read_text()
    start = readme.index("## A tour of the loop")
    tour = readme[start:readme.index("\n## ", start + 1)]
    steps = re.findall(r"^(\d)\. \*\*([^*.]+)", tour, re.M)
    code = re.findall(r"^\s+# (\d)\. ", (ROOT / "rlcore" / "train.py").read_text(), re.M)
    assert [n for n, _ in steps] == code == [str(i) for i in range(1, 7)], (steps, code)
    # the first word of each tour title is in the comment of the same number
    comments = dict(re.findall(r"^\s+# (\d)\. (.*)$", (ROOT / "rlcore" / "train.py").read_text(), re.M))
    for n, title in steps:
        assert title.split()[0].strip("/").lower() in comments[n].lower(), (n, title, comments[n])


def test_every_readme_table_has_a_header_and_rows_of_its_width():
    """A Markdown table is a header row, a |---| row, then rows with as many cells; a line pasted
    into a table (or a row missing its first cell) breaks how it renders from there on."""
    lines = (ROOT / "README.md").read_text().splitlines()
    k = 0
    while k < len(lines):
        if not lines[k].startswith("|"):
            assert not (lines[k].rstrip().endswith("|") and " | " in lines[k]), \
                f"README.md:{k + 1} looks like a table row without its first cell: {lines[k][:80]}"
            k += 1
            continue
        width = lines[k].count(" | ")
        assert k + 1 < len(lines) and set(lines[k + 1].replace("|", "")) <= set("-: "), \
            f"README.md:{k + 1} starts a table with no |---| row under it: {lines[k][:80]}"
        k += 2
        while k < len(lines) and lines[k].startswith("|"):
            cells = lines[k].replace("\\|", "").split(" | ")
            assert len(cells) - 1 == width, f"README.md:{k + 1} has {len(cells)} cells, its table {width + 1}"
            k += 1
