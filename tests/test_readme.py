"""The README's options table is generated from the config's field docs; keep them in sync."""

from pathlib import Path

from rlcore.config import options_table


def test_readme_options_table_matches_the_config():
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    assert options_table().strip() in readme, "regenerate with: python -c 'from rlcore.config import options_table; print(options_table())'"
