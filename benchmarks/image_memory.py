"""Router-side memory of checking a chat request's images: peak and settled RSS.

The request is the hardening probe's: ``--images`` (7) black RGB PNGs of ``--side``
(9400) pixels square, about 250 KB each (1.7 MB of PNG, 2.5 GB once Pillow has decoded
them: RGB takes 4 bytes a pixel), sent as data URLs, ``--concurrent`` (1) requests at once
in threads (the router calls ``ImagePrompter.prompt`` via ``asyncio.to_thread``), twice
in a row (``--rounds``). Each
path runs in a fresh Python process; all are measured in the same run:

* ``old``: what ``parse_chat_images`` did before the decode budget: every image decoded
  in full and held until the request was laid out, nothing given back to the OS;
* ``new``: ``parse_chat_images`` with the default ``MediaOptions``: the request is over
  the per-request budget and refused (413) from the headers, before any decoding;
* ``new-decoded``: ``parse_chat_images`` with the per-request budget raised so that the
  request is decoded (one image at a time, pixels dropped after each check);
* ``new-notrim``: as ``new-decoded`` without ``malloc_trim`` (is it needed?).

Peak is VmHWM after resetting it (``/proc/self/clear_refs``) once the PNGs are built;
settled is VmRSS after the last requests returned. Linux only. Usage::

    PYTHONPATH=. python benchmarks/image_memory.py [--images 7] [--side 9400] [--concurrent 1]
"""

from __future__ import annotations

import argparse
import base64
import json
import struct
import subprocess
import sys
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from epdserve.serving.api.errors import APIError

PATHS = ("old", "new", "new-decoded", "new-notrim")


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def black_pngs(n: int, side: int, step: int) -> list[bytes]:
    """``n`` black RGB PNGs of sides ``side``, ``side - step``, ... pixels square, their
    bytes made distinct by a tEXt chunk (so no path can skip one as a repeat); each size
    compressed once, in 64-row chunks (little memory)."""
    idats = {}
    out = []
    for i in range(n):
        width = side - i * step
        if width not in idats:
            row = b"\0" * (1 + 3 * width)  # filter byte + RGB
            z = zlib.compressobj(9)
            idats[width] = b"".join(z.compress(row * min(64, width - y)) for y in range(0, width, 64)) + z.flush()
        out.append(b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", struct.pack(">IIBBBBB", width, width, 8, 2, 0, 0, 0))
                   + png_chunk(b"tEXt", b"probe\0%d" % i) + png_chunk(b"IDAT", idats[width]) + png_chunk(b"IEND", b""))
    return out


def status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(field)


def child(path: str, n: int, side: int, step: int, concurrent: int, rounds: int) -> dict:
    from epdserve.model.image_processor import load_image
    from epdserve.serving.api import multimodal
    from epdserve.serving.api.multimodal import MediaOptions, parse_chat_images

    pngs = black_pngs(n, side, step)
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(p).decode()}}
        for p in pngs] + [{"type": "text", "text": "What is this?"}]}]

    def old() -> list:
        images = [load_image(base64.b64decode(part["image_url"]["url"].split(",", 1)[1]))
                  for part in messages[0]["content"][:-1]]
        return [im.size for im in images]

    def new() -> str:
        options = MediaOptions() if path == "new" else MediaOptions(max_request_decoded_bytes=1 << 40)
        try:
            return [im.size for im in parse_chat_images(messages, options)[1]]
        except APIError as exc:
            return f"{exc.status}: {exc.message}"

    if path == "new-notrim":
        multimodal._malloc_trim = None
    baseline = status_mb("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrent) as pool:  # kept across rounds, as asyncio's default executor is
        for _ in range(rounds):
            results = list(pool.map(lambda _: old() if path == "old" else new(), range(concurrent)))
    seconds = time.perf_counter() - start
    time.sleep(0.2)
    return {"path": path, "baseline_mb": baseline, "peak_mb": status_mb("VmHWM"), "settled_mb": status_mb("VmRSS"),
            "seconds": seconds, "result": str(results[0])[:90], "png_bytes": sum(map(len, pngs))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=7)
    parser.add_argument("--side", type=int, default=9400)
    parser.add_argument("--side-step", type=int, default=0,
                        help="image i is side - i * step pixels square (mixed sizes defeat glibc's mmap threshold)")
    parser.add_argument("--concurrent", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2,
                        help="requests (or concurrent batches) one after the other: glibc keeps freed memory from"
                             " the second on (its mmap threshold rises after the first large free)")
    parser.add_argument("--paths", default=",".join(PATHS), help="comma-separated, of " + ", ".join(PATHS))
    parser.add_argument("--child", choices=PATHS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.images, args.side, args.side_step, args.concurrent, args.rounds)))
        return
    print(f"{args.rounds} x {args.concurrent} request(s) at once, each {args.images} PNGs of {args.side}x{args.side}"
          + (f" minus {args.side_step} a side per image" if args.side_step else ""))
    rows = []
    for path in args.paths.split(","):
        argv = ["--child", path, "--images", args.images, "--side", args.side, "--side-step", args.side_step,
                "--concurrent", args.concurrent, "--rounds", args.rounds]
        out = subprocess.run([sys.executable, __file__, *map(str, argv)], capture_output=True, text=True,
                             check=True).stdout
        rows.append(json.loads(out.splitlines()[-1]))
    print(f"request: {rows[0]['png_bytes'] / 1e6:.2f} MB of PNG")
    print(f"{'path':<12} {'peak +MB':>9} {'settled +MB':>12} {'seconds':>8}  result")
    for r in rows:
        print(f"{r['path']:<12} {r['peak_mb'] - r['baseline_mb']:>9.0f} {r['settled_mb'] - r['baseline_mb']:>12.0f}"
              f" {r['seconds']:>8.2f}  {r['result']}")
    old = next((r for r in rows if r["path"] == "old"), None)
    if old:
        def growth(r: dict, key: str) -> float:
            return max(r[key] - r["baseline_mb"], 1.0)  # >= 1 MB: no division by zero, no negative ratio

        for r in rows:
            if r is not old:
                print(f"{r['path']} / old: peak {growth(r, 'peak_mb') / growth(old, 'peak_mb'):.3f},"
                      f" settled {growth(r, 'settled_mb') / growth(old, 'settled_mb'):.3f}")


if __name__ == "__main__":
    main()
