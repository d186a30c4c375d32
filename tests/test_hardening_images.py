"""Hardening of chat image inputs (epdserve.serving.api.multimodal): the router's memory while
checking big images, the per-request and process-wide decode budgets, and 4xx (never a
crash, never internal exception text) for NUL bytes, image tokens in roles and names, and
lone surrogates."""

from __future__ import annotations

import struct
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from PIL import Image

from epdserve.serving.api import multimodal
from epdserve.serving.api.multimodal import ImagePrompter, MediaOptions, parse_chat_images
from test_multimodal_inputs import PNG, chat, data_url
from test_vision import encoded, gradient, png_chunk
from epdserve.serving.api.errors import APIError

pytestmark = pytest.mark.faults

PARAM = "messages[0].content[0].image_url"


def black_png(side: int, tag: int = 0, idat: bytes | None = None) -> bytes:
    """A black RGB PNG of ``side`` pixels square (~1000x compressed; ``tag`` in a tEXt
    chunk makes the bytes distinct). ``idat``: use these bytes as the image data instead
    (a header-only image: nothing decodes)."""
    if idat is None:
        row = b"\0" * (1 + 3 * side)
        z = zlib.compressobj(9)
        idat = b"".join(z.compress(row * min(64, side - y)) for y in range(0, side, 64)) + z.flush()
    return (b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0))
            + png_chunk(b"tEXt", b"tag\0%d" % tag) + png_chunk(b"IDAT", idat) + png_chunk(b"IEND", b""))


def status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def refused(messages, options: MediaOptions = MediaOptions(), status: int = 400) -> APIError:
    with pytest.raises(APIError) as info:
        parse_chat_images(messages, options)
    assert info.value.status == status, info.value.message
    return info.value


def test_checking_big_images_holds_one_at_a_time_and_gives_the_memory_back():
    """Four distinct 3000x3000 PNGs (36 MB each decoded, 4 bytes a pixel) checked in a
    thread, as the router does: the peak RSS grows by about one image, not four, and the
    pixels are neither kept nor left in glibc's heaps afterwards. (Before: +144 MB peak,
    all of it still held by the returned images.)"""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM (peak RSS) to the current RSS
    except OSError:
        pytest.skip("needs Linux /proc/self/clear_refs")
    side, n = 3000, 4
    one = side * side * 4
    messages = chat(*[data_url(black_png(side, tag)) for tag in range(n)])
    with ThreadPoolExecutor(1) as pool:
        pool.submit(lambda: None).result()  # the thread exists (its stack counted) before the baseline
        before = status_bytes("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        _, images = pool.submit(parse_chat_images, messages).result()
        peak, after = status_bytes("VmHWM"), status_bytes("VmRSS")
    assert peak - before < 1.5 * one, f"peak +{(peak - before) / 1e6:.0f} MB"
    assert after - before < 0.25 * one, f"settled +{(after - before) / 1e6:.0f} MB"
    assert [im.size for im in images] == [(side, side)] * n


def test_a_request_over_the_decode_budget_is_refused_from_the_headers():
    """The probe's request (seven 9400x9400 RGB PNGs, 353 MB each decoded) with the
    default 1 GiB budget: 413 naming the fourth image, before anything is decoded (the
    images here are headers over garbage data, which would fail to decode: 400)."""
    garbage = zlib.compress(b"\1" * 100)
    err = refused(chat(*[data_url(black_png(9400, tag, idat=garbage)) for tag in range(7)]), status=413)
    assert err.param == "messages[0].content[3].image_url" and err.type == "invalid_request_error"
    assert err.message == ("data:image/png: a 9400x9400 RGB image takes 353440000 bytes decoded, bringing the"
                           " request's images to 1413760000 bytes, over the limit of 1073741824 bytes per request")
    # One image over the budget alone.
    err = refused(chat(data_url(PNG)), MediaOptions(max_request_decoded_bytes=20_000), status=413)
    assert err.param == PARAM and "100x70 RGB image takes 28000 bytes decoded, bringing the request's images to" \
        " 28000 bytes, over the limit of 20000 bytes per request" in err.message
    # WebP counts 4x: Pillow's decoder holds copies of libwebp's output next to the image.
    err = refused(chat(data_url(encoded(gradient(100, 70), "WEBP"), "image/webp")),
                  MediaOptions(max_request_decoded_bytes=100_000), status=413)
    assert "100x70 RGB image takes 112000 bytes decoded" in err.message
    # Under it, decoded and checked as before: a corrupt image is still 400.
    _, images = parse_chat_images(chat(data_url(PNG), data_url(PNG)), MediaOptions(max_request_decoded_bytes=56_000))
    assert len(images) == 2
    err = refused(chat(data_url(black_png(64, idat=garbage))))
    assert err.param == PARAM and "corrupt or truncated PNG image" in err.message


def hold(n: int):
    """Hold ``n`` bytes of the process-wide decode budget, as another request would."""
    assert multimodal._DECODING.acquire(n, n, 0)
    return n


def test_the_process_wide_budget_waits_then_answers_503():
    png = encoded(gradient(600, 500), "PNG")  # 1.2 MB decoded
    options = MediaOptions(max_decoding_bytes=2_000_000, decode_wait_s=0.2)
    held = hold(1_000_000)
    try:
        start = time.monotonic()
        err = refused(chat(data_url(PNG), data_url(png)), options, status=503)
        assert 0.2 <= time.monotonic() - start < 2
        assert (err.param, err.type) == ("messages[0].content[1].image_url", "service_unavailable")
        assert err.message == ("the server is busy decoding other images: no room for this one (1200000 bytes) in"
                               " its 2000000 byte decode budget within 0.2 s; retry later")
        # A JPEG is checked at 1/8 scale: 2000x1600 takes 200 KB of the budget, not 12.8 MB.
        jpeg = encoded(Image.fromarray(np.random.default_rng(0).integers(0, 256, (1600, 2000, 3), np.uint8)), "JPEG")
        _, images = parse_chat_images(chat(data_url(jpeg, "image/jpeg")), options)
        assert images[0].size == (2000, 1600)  # the full size, for the tile layout
        # Released while a request waits: it goes on.
        threading.Timer(0.2, multimodal._DECODING.release, [held]).start()
        held = 0
        _, images = parse_chat_images(chat(data_url(png)), MediaOptions(max_decoding_bytes=2_000_000, decode_wait_s=10))
        assert images[0].size == (600, 500)
    finally:
        multimodal._DECODING.release(held)
    deadline = time.monotonic() + 5
    while multimodal._DECODING.held and time.monotonic() < deadline:
        time.sleep(0.01)
    assert multimodal._DECODING.held == 0  # every check gave its bytes back
    # Alone, an image over the whole budget is still checked.
    assert parse_chat_images(chat(data_url(png)), MediaOptions(max_decoding_bytes=1000))[1][0].size == (600, 500)


def test_nul_bytes_in_local_paths_are_400(tmp_path):
    (tmp_path / "a.png").write_bytes(PNG)
    options = MediaOptions(allowed_local_dir=tmp_path)
    assert parse_chat_images(chat(str(tmp_path / "a.png")), options)[1][0].size == (100, 70)
    for url in (f"{tmp_path}/a\0.png", f"file://{tmp_path}/a%00.png", f"file://{tmp_path}/a\0.png"):
        err = refused(chat(url), options)
        assert (err.param, err.message) == (PARAM, "image path contains a NUL byte")


@pytest.mark.parametrize("token", ["<image>", "<fake_token_around_image>", "<global-img>", "<row_2_col_3>"])
@pytest.mark.parametrize("key", ["role", "name"])
def test_image_tokens_in_role_or_name_are_400(key, token):
    message = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(PNG)}}]}
    message[key] = f"user{token}"
    err = refused([message])
    assert err.param == f"messages[0].{key}"
    assert err.message == (f"a {key} may not contain the image placeholder <image> or another image token"
                           f" (found {token}); send images as image_url parts")


def test_other_image_tokens_in_text_are_400():
    err = refused(chat(data_url(PNG), text="<row_1_col_1> <global-img>"))
    assert err.param == "messages[0].content[1].text" and "(found <row_1_col_1>)" in err.message


@pytest.mark.parametrize("url", [
    "data:image/png;base64,\udc80AAAA", "data:image/\ud800;base64,AAAA", "/media/\ud800.png", "/media/\udc80.png",
    "file:///media/\ud800.png", "http://example.com/\ud800.png",
], ids=["data", "media-type", "path", "path-low", "file-url", "http"])
def test_lone_surrogates_in_image_urls_are_400(url):
    err = refused(chat(url), MediaOptions(allowed_local_dir="/media", allow_remote=True))
    assert (err.param, err.message) == (PARAM, "image URL is not valid Unicode: it contains a lone surrogate")


@pytest.mark.parametrize("messages, param, message", [
    (chat(data_url(PNG), text="caf\udce9"), "messages[0].content[1].text", "text is not valid Unicode"),
    ([{"role": "us\ud800er", "content": "hi"}], "messages[0].role", "a role is not valid Unicode"),
    ([{"role": 3, "content": "hi"}], "messages[0].role", "role must be a string"),
    (["hi"], "messages[0]", "a message must be an object"),
    (chat("data:image/png;base64,\u00e9AAA"), PARAM, "invalid base64 in data URL"),
    (chat("file://[::1/x.png"), PARAM, "invalid file URL"),
    (chat("http://[::1/x.png"), PARAM, "invalid image URL http://[::1/x.png"),
], ids=["text-surrogate", "role-surrogate", "role-int", "message-str", "non-ascii-base64", "file-bad-host",
        "http-bad-host"])
def test_other_malformed_inputs_are_400(messages, param, message):
    err = refused(messages, MediaOptions(allowed_local_dir="/media", allow_remote=True))
    assert err.param == param and err.message.startswith(message)


@pytest.fixture(scope="module")
def prompter():
    from epdserve.model.loader import resolve_model
    from epdserve.model.tokenizer import load_tokenizer

    info = resolve_model("vlm")
    return ImagePrompter(info.path, load_tokenizer(info.path), MediaOptions())


def test_prompter_lays_out_from_the_size_and_maps_faults(prompter):
    """The tile layout comes from the header size; ``<image>`` in a role is 400 (before:
    a ValueError, 500); a template that loses placeholders is a 500 server error."""
    big = encoded(gradient(1000, 700), "PNG")
    ids, refs = prompter.prompt(chat(data_url(big), data_url(PNG)))
    grids = [prompter.processor.grid((1000, 700)), prompter.processor.grid((100, 70))]
    assert [r.tokens for r in refs] == [prompter.processor.num_tokens(g) for g in grids]
    image_id = prompter.tokenizer.convert_tokens_to_ids("<image>")
    assert ids.count(image_id) == sum(r.tokens for r in refs) and refs[0].data == big
    with pytest.raises(APIError) as info:
        prompter.prompt([{"role": "<image>", "content": [{"type": "image_url", "image_url": data_url(PNG)}]}])
    assert (info.value.status, info.value.param) == (400, "messages[0].role")
    template = prompter.tokenizer.chat_template
    prompter.tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}{% endfor %}"
    try:
        with pytest.raises(APIError) as info:
            prompter.prompt(chat(data_url(PNG)))
    finally:
        prompter.tokenizer.chat_template = template
    assert (info.value.status, info.value.type) == (500, "internal_server_error")
    assert info.value.message == ("the chat template's output does not match the images: prompt has 0 <image>"
                                  " placeholders for 1 images")
