"""The task guides in docs/guides/ run: each guide's ```python blocks, in
order, as one script in a fresh interpreter (in a temporary directory)."""

import pathlib
import re
import subprocess
import sys

import pytest

GUIDES = pathlib.Path(__file__).resolve().parents[3] / "docs" / "guides"
NAMES = ["classification", "segmentation", "detection", "custom_task", "from_super_gradients"]


def test_a_guide_per_task():
    assert sorted(p.stem for p in GUIDES.glob("*.md")) == sorted(NAMES)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.slow
def test_guide_snippets_run(tmp_path, name):
    text = (GUIDES / f"{name}.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, f"{name}.md has no python snippet"
    script = tmp_path / f"{name}.py"
    script.write_text("import torch\ntorch.set_num_threads(1)\n" + "\n".join(blocks))
    proc = subprocess.run([sys.executable, str(script)], cwd=str(tmp_path), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (tmp_path / "runs").is_dir()
