"""The README and docs/ against what they describe: docs/options.md's table is generated from the
config's field docs, the README's test command is CI's, the tour follows train.py, every table
renders, and every relative link resolves. docs/SPEC.md is the repository's copy of the team's
contract; keep it equal to the source."""

import re
from pathlib import Path

import pytest

from rlcore.config.values import options_table

ROOT = Path(__file__).parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_docs_options_table_matches_the_config():
    """Row by row, so a failure shows the row that differs; `rlcore options` prints the table."""
    want = options_table().strip().splitlines()
    lines = (ROOT / "docs" / "options.md").read_text().splitlines()
    start = lines.index(want[0])  # the table's header row
    got = lines[start:start + len(want)]
    for row_want, row_got in zip(want, got):
        assert row_got == row_want, f"docs/options.md's options table differs; paste `rlcore options` over it:\n" \
                                    f"docs: {row_got}\nconfig: {row_want}"
    assert len(got) == len(want) and (len(lines) == start + len(want) or not lines[start + len(want)].startswith("|"))


def test_readme_test_command_is_the_one_ci_runs():
    """The README's second command, byte for byte, is the last line of .ci/run."""
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    blocks = re.findall(r"^```bash\n(.*?)\n```$", (ROOT / "README.md").read_text(), re.M | re.S)
    assert ci in blocks, f"README.md has no ```bash block that is .ci/run's command {ci!r}: {blocks}"


def test_docs_spec_is_the_shared_contract_where_that_is_checked_out():
    source = ROOT.parent / "shared" / "SPEC.md"
    if not source.is_file():
        pytest.skip(f"{source} is not here to compare with (only the team's workspace has it)")
    assert (ROOT / "docs" / "SPEC.md").read_text() == source.read_text(), f"copy {source} to docs/SPEC.md"


def test_readme_tour_steps_are_train_py_numbered_comments_in_order():
    """The tour's "1. **Rollout.**" .. "6. **Metrics**" are train.py's "# 1. Rollout" .. "# 6. Metrics"."""
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


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_table_has_a_header_and_rows_of_its_width(page):
    """A Markdown table is a header row, a |---| row, then rows with as many cells; a line pasted
    into a table (or a row missing its first cell) breaks how it renders from there on."""
    lines = page.read_text().splitlines()
    name = page.relative_to(ROOT)
    k = 0
    while k < len(lines):
        if not lines[k].startswith("|"):
            assert not (lines[k].rstrip().endswith("|") and " | " in lines[k]), \
                f"{name}:{k + 1} looks like a table row without its first cell: {lines[k][:80]}"
            k += 1
            continue
        width = lines[k].count(" | ")
        assert k + 1 < len(lines) and set(lines[k + 1].replace("|", "")) <= set("-: "), \
            f"{name}:{k + 1} starts a table with no |---| row under it: {lines[k][:80]}"
        k += 2
        while k < len(lines) and lines[k].startswith("|"):
            cells = lines[k].replace("\\|", "").split(" | ")
            assert len(cells) - 1 == width, f"{name}:{k + 1} has {len(cells)} cells, its table {width + 1}"
            k += 1


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation but - and _ dropped,
    spaces as -, and -1, -2, ... after a repeated one."""
    seen, out = {}, set()
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)  # no headings in code
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        out.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_relative_link_points_at_a_file_and_heading_that_exist(page):
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)  # links in code are not links
    text = re.sub(r"`[^`\n]*`", "", text)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target} (no file {file.relative_to(ROOT.resolve())})")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target} (no heading #{anchor} in {file.name})")
    assert not broken, f"{page.relative_to(ROOT)} links to what is not there: {broken}"


def test_the_readme_links_every_docs_page():
    linked = {(ROOT / target.partition("#")[0]).resolve()
              for target in re.findall(r"\]\((docs/[^)\s]+)\)", (ROOT / "README.md").read_text())}
    unlinked = [page.name for page in sorted((ROOT / "docs").glob("*.md")) if page.resolve() not in linked]
    assert not unlinked, f"README.md links no page {unlinked}: add it to its Documentation list"
