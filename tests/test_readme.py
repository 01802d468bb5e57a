"""The README's code blocks run as written (a newcomer's first contact must not be stale)."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)


@pytest.mark.parametrize("index", range(len(python_blocks())))
def test_readme_block_runs(index, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the quickstart writes xq.pt
    exec(compile(python_blocks()[index], f"README block {index}", "exec"), {})
    if "print(type(recipe).__name__" in python_blocks()[index]:
        losses = [float(line.split()[-1]) for line in capsys.readouterr().out.splitlines()
                  if line.split()[0].endswith(("Scaling",))]
        assert len(losses) == 5 and all(loss == loss for loss in losses)  # finite, not NaN
