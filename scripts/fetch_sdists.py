#!/usr/bin/env python3
"""Download pinned source distributions from PyPI's simple index, checked against their sha256.

`pip download --no-binary :all:` also prepares each package's metadata, which for numpy, scipy
or pandas means building their build tools (cmake, meson) from source: close to an hour of a
2-core machine for a tarball whose docstrings are all that is wanted. This only downloads.

Usage: scripts/fetch_sdists.py DIR NAME==VERSION=SHA256 ...
A file already in DIR with the right hash is kept; a wrong hash is an error, never a silent use.
"""
import hashlib
import re
import sys
import urllib.request
from pathlib import Path


def main() -> int:
    if len(sys.argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for spec in sys.argv[2:]:
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)==([^=]+)=([0-9a-f]{64})", spec)
        if not m:
            print(f"bad spec {spec!r}: expected NAME==VERSION=SHA256", file=sys.stderr)
            return 2
        name, version, sha = m.groups()
        have = list(out.glob(f"*-{version}.tar.gz"))
        have = [p for p in have if hashlib.sha256(p.read_bytes()).hexdigest() == sha]
        if have:
            print(f"{spec.split('=')[0]}: have {have[0].name}", file=sys.stderr)
            continue
        index = urllib.request.urlopen(f"https://pypi.org/simple/{name}/", timeout=120).read().decode()
        links = [h for h in re.findall(r'href="([^"]+)"', index) if h.endswith(f"#sha256={sha}")]
        if not links:
            print(f"{name}=={version}: no file with sha256 {sha} on PyPI", file=sys.stderr)
            return 1
        url = links[0].split("#")[0]
        data = urllib.request.urlopen(url, timeout=600).read()
        if hashlib.sha256(data).hexdigest() != sha:
            print(f"{name}=={version}: download does not match sha256 {sha}", file=sys.stderr)
            return 1
        dest = out / url.rsplit("/", 1)[1]
        tmp = dest.with_suffix(".part")
        tmp.write_bytes(data)
        tmp.rename(dest)
        print(f"{name}=={version}: {dest.name} ({len(data) // 1024} KB)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
