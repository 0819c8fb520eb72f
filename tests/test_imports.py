"""rlcore runs without transformers: importing every module must not pull it in."""

import subprocess
import sys


def test_importing_rlcore_does_not_import_transformers_or_trl():
    code = ("import sys, rlcore, rlcore.train, rlcore.cli, rlcore.models.transformer, rlcore.models.hf_checkpoint, "
            "rlcore.models.tokenizer, rlcore.rollout, rlcore.losses, rlcore.models.embedded, rlcore.models.lora; "
            "print(sorted(m for m in ('transformers', 'trl', 'accelerate') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
