"""Write the peers' benchmark DAG (../shared/bench/peers) as a mopt recipe of `command` targets.

M models × 5 chained stages, each `sha1sum <in> > <out>`; stage 1 reads weights/mNNN.bin.
"""

from __future__ import annotations

import argparse
from pathlib import Path

STAGES = ["sanitize", "export", "quantize", "validate", "bench"]


def model_name(models: int, i: int) -> str:
    """The name of model `i` of a DAG of `models` models (m000, m001, ...)."""
    width = max(3, len(str(models - 1)))
    return f"m{i:0{width}d}"


def write(root: Path, models: int, folder: str = "mopt") -> Path:
    d = root / folder
    d.mkdir(parents=True, exist_ok=True)
    names = [model_name(models, i) for i in range(models)]
    lines = ["schema = 1", "", "[defaults]", f"targets = {STAGES!r}".replace("'", '"'), ""]
    prev = None
    for s in STAGES:
        lines.append(f"[defaults.{s}]")
        lines.append('kind = "command"')
        if prev is None:
            lines.append('files = ["../weights/{model}.bin"]')  # beside every folder
            lines.append('argv = ["sh", "-c", "sha1sum {file} > {out}/out"]')
        else:
            lines.append(f'input = "{prev}"')
            lines.append('argv = ["sh", "-c", "sha1sum {in}/out > {out}/out"]')
        lines.append("")
        prev = s
    for m in names:
        lines += [f"[models.{m}]", f"[{m}.cpu]", ""]
    (d / "dag.toml").write_text("\n".join(lines))
    (d / "mopt.toml").write_text('[store]\npath = ".mopt"\n')
    return d / "dag.toml"


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("root")
    ap.add_argument("-M", type=int, default=40)
    a = ap.parse_args()
    print(write(Path(a.root), a.M))
