"""The README's options table is generated from the config's field docs; keep them in sync.
docs/SPEC.md is the repository's copy of the team's contract; keep it equal to the source."""

from pathlib import Path

import pytest

from rlcore.config import options_table

ROOT = Path(__file__).parent.parent


def test_readme_options_table_matches_the_config():
    readme = (ROOT / "README.md").read_text()
    assert options_table().strip() in readme, "regenerate with: rlcore options"


def test_docs_spec_is_the_shared_contract_where_that_is_checked_out():
    source = ROOT.parent / "shared" / "SPEC.md"
    if not source.is_file():
        pytest.skip(f"{source} is not here to compare with (only the team's workspace has it)")
    assert (ROOT / "docs" / "SPEC.md").read_text() == source.read_text(), f"copy {source} to docs/SPEC.md"
