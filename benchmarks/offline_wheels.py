"""Wheels for a GPU machine with no package index: every distribution minigpt (with the serve extra) needs that
the machine lacks, at the versions installed here (the pinned ones the suite runs against).

    python benchmarks/offline_wheels.py --have their_packages.txt --dest wheels/

--have: what the machine already has, one name per line (`pip list --format=freeze` there does; versions are
ignored). torch and its CUDA libraries are never fetched: that machine's own torch is the one that drives its GPU.
There: `pip install --no-index --no-deps --target SITE wheels/*.whl` and SITE on PYTHONPATH
(benchmarks/gpu_session.sh does it).
"""

import argparse
import importlib.metadata as metadata
import re
import subprocess
import sys

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]
NEVER = re.compile(r"torch|triton|nvidia-.*|cuda-.*|minigpt")  # the GPU machine's own, or this checkout


def name_of(requirement: str) -> str:
    """The distribution's normalized name in a requirement or `pip freeze` line (name==version)."""
    return canonicalize_name(re.split(r"[\s=<>!~;\[(]", requirement.strip(), maxsplit=1)[0])


def closure(root: str, extras: set[str], python: str) -> dict[str, str]:
    """Every distribution `root[extras]` needs on Linux x86-64 under `python`, with the version installed here."""
    environment = dict(python_version=python, python_full_version=f"{python}.0", sys_platform="linux")
    environment |= dict(platform_system="Linux", platform_machine="x86_64", os_name="posix")
    found: dict[str, str] = {}
    seen: set[tuple[str, frozenset[str]]] = set()
    todo = [(root, frozenset(extras), "")]
    while todo:
        name, wanted, parent = todo.pop()
        if (name_of(name), wanted) in seen:
            continue
        seen.add((name_of(name), wanted))
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:  # the version to fetch is the one installed here
            raise SystemExit(
                f"{name} ({parent} needs it on Python {python}) is not installed here: pip install it"
            ) from None
        found[name_of(name)] = dist.version
        for line in dist.requires or []:
            req = Requirement(line)
            active = req.marker is None or any(req.marker.evaluate(environment | {"extra": e}) for e in {""} | wanted)
            if active:
                todo.append((req.name, frozenset(req.extras), name))
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))  # the first paragraph
    p.add_argument("--have", required=True, help="the machine's installed distributions, one name per line")
    p.add_argument("--dest", required=True, help="folder for the wheels")
    p.add_argument("--python", default="3.12", help="the machine's Python (major.minor; default 3.12)")
    p.add_argument("--extras", default="serve", help="minigpt's extras to include, comma-separated")
    args = p.parse_args()
    try:
        have = {name_of(line) for line in open(args.have) if line.strip() and not line.startswith("#")}
    except OSError as e:
        p.error(f"--have {args.have}: {e.strerror}")
    needed = closure("minigpt", set(filter(None, args.extras.split(","))), args.python)
    missing = {name: version for name, version in needed.items() if name not in have and not NEVER.fullmatch(name)}
    if not missing:
        print("nothing to fetch: the machine has every distribution minigpt needs")
        return
    print("fetching:", " ".join(f"{n}=={v}" for n, v in sorted(missing.items())), flush=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", args.dest]
    cmd += ["--python-version", args.python, "--implementation", "cp"]
    cmd += [f"--platform={platform}" for platform in PLATFORMS]
    subprocess.run(cmd + [f"{n}=={v}" for n, v in sorted(missing.items())], check=True)


if __name__ == "__main__":
    main()
