"""Keep torch.compile's on-disk caches from replaying graphs of another minifloat source.

Why: inductor's FX-graph and AOTAutograd caches key a compiled graph by the graph dynamo
traced, and that graph holds only the call of minifloat::gemms_forward. The backward graph is
traced from the op's autograd formula (modules/gemm_op.py), whose code, like the custom ops'
schemas, is not in the key. After an upgrade that changes either, a cache hit replays a backward
graph that calls the ops with the old arguments (found in development: "gemms_backward() is
missing value for argument"). The fix is torch's own knob for breaking caches,
torch.compiler.config.cache_key_tag: minifloat appends a digest of its source files to it.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

PACKAGE_ROOT = Path(__file__).resolve().parent


def source_tag(root: Path = PACKAGE_ROOT) -> str:
    """'minifloat:<digest>' of every .py file under `root` (names and contents, in order)."""
    digest = hashlib.sha1()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return f"minifloat:{digest.hexdigest()[:16]}"


def tag_compile_caches() -> str:
    """Append this source's tag to torch.compiler.config.cache_key_tag (once); returns it."""
    tag = source_tag()
    current = torch.compiler.config.cache_key_tag
    if tag not in current.split():
        torch.compiler.config.cache_key_tag = f"{current} {tag}".strip()
    return tag
