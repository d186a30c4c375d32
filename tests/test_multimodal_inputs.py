"""Image inputs of a chat request (epdserve.serving.api.multimodal): data URLs, local files,
refused remote URLs, limits, and the error (OpenAI ``param`` + message) for each bad
input."""

from __future__ import annotations

import base64
import hashlib
import http.server
import threading

import pytest

from epdserve.serving.api.multimodal import MediaOptions, parse_chat_images
from test_vision import BOMB_PNG, encoded, gradient
from epdserve.serving.api.errors import APIError

PNG = encoded(gradient(100, 70), "PNG")
JPEG = encoded(gradient(60, 40), "JPEG")


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def chat(*urls, text: str = "What is this?") -> list[dict]:
    """One user message: an image_url part per URL, then a text part."""
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": u}} for u in urls]
             + [{"type": "text", "text": text}]}]


def refused(messages, options: MediaOptions = MediaOptions()) -> APIError:
    with pytest.raises(APIError) as info:
        parse_chat_images(messages, options)
    assert info.value.status == 400
    return info.value


def test_png_and_jpeg_data_urls_in_order():
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "name": "ann", "content": [
                    {"type": "text", "text": "First"}, {"type": "image_url", "image_url": {"url": data_url(PNG)}},
                    {"type": "text", "text": "then"},
                    # vLLM's short form, and OpenAI's detail field
                    {"type": "image_url", "image_url": data_url(JPEG, "image/jpeg")}]},
                {"role": "user", "content": [{"type": "image_url",
                                              "image_url": {"url": data_url(PNG), "detail": "low"}}]}]
    out, images = parse_chat_images(messages)
    assert out == [{"role": "system", "content": "Be brief."},
                   {"role": "user", "name": "ann", "content": "First\n<image>\nthen\n<image>"},
                   {"role": "user", "content": "<image>"}]
    assert [im.source for im in images] == ["data:image/png", "data:image/jpeg", "data:image/png"]
    assert [im.size for im in images] == [(100, 70), (60, 40), (100, 70)]
    assert [im.image for im in images] == [None] * 3  # checked, pixels not kept: the router needs the size
    assert [im.content_hash for im in images] == [hashlib.sha256(d).hexdigest() for d in (PNG, JPEG, PNG)]
    assert images[0].data == PNG


@pytest.mark.parametrize("url, message", [
    (data_url(PNG)[:-3] + "!!=", "invalid base64 in data URL"),
    ("data:image/png," + "abc", "data URL must be data:<media type>;base64,<data>"),
    (data_url(PNG, "text/plain"), "unsupported image media type 'text/plain'"),
    (data_url(PNG[:131]), "data:image/png: corrupt or truncated PNG image: image file is truncated"),
    (data_url(b"\x00" * 300), "data:image/png: cannot decode image: not an image or corrupt data"),
    (data_url(encoded(gradient(30, 20), "TIFF")), "unsupported image format TIFF"),
    (data_url(BOMB_PNG), "data:image/png: image rejected as a decompression bomb"),
    ("http://example.com/cat.png", "http(s) image URLs are disabled on this server"),
    ("https://example.com/cat.png", "http(s) image URLs are disabled on this server"),
    ("/etc/hostname", "local image files are disabled on this server"),
    ("file:///etc/hostname", "local image files are disabled on this server"),
    ("cat.png", "image URL must be a data:, file: or http(s): URL or an absolute path"),
], ids=["bad-base64", "not-base64", "media-type", "truncated", "corrupt", "tiff", "bomb", "http", "https",
        "local-path", "file-url", "relative"])
def test_bad_image_url(url, message):
    err = refused(chat(data_url(PNG), url))
    assert err.param == "messages[0].content[1].image_url"
    assert message in err.message


def test_limits():
    err = refused(chat(*[data_url(PNG)] * 3), MediaOptions(max_images=2))
    assert (err.param, err.message) == ("messages", "3 images in the request, more than the limit of 2")
    err = refused(chat(data_url(PNG)), MediaOptions(max_image_bytes=100))
    assert err.param == "messages[0].content[0].image_url"
    assert err.message == f"data:image/png: image is {len(PNG)} bytes, over the limit of 100 bytes"
    err = refused(chat(data_url(PNG)), MediaOptions(max_image_pixels=5000))
    assert "image is 100x70 = 7000 pixels, over the limit of 5000 pixels" in err.message


@pytest.mark.parametrize("content, param, message", [
    ([{"type": "input_audio"}], "messages[0].content[0].type", "unsupported content part type 'input_audio'"),
    (["hi"], "messages[0].content[0].type", "unsupported content part type None"),
    ([{"type": "text"}], "messages[0].content[0].text", "a text part needs a string 'text'"),
    ([{"type": "image_url", "image_url": {"detail": "low"}}], "messages[0].content[0].image_url",
     "image_url must be a URL string or an object with a string 'url'"),
    ([{"type": "image_url", "image_url": {"url": data_url(PNG), "detail": "max"}}],
     "messages[0].content[0].image_url.detail", "detail must be one of auto, low, high, got 'max'"),
    ([{"type": "text", "text": "see <image>"}], "messages[0].content[0].text", "may not contain the image placeholder"),
    ("see <image>", "messages[0].content", "may not contain the image placeholder"),
    (7, "messages[0].content", "content must be a string or a list of content parts"),
], ids=["audio", "bare-string", "no-text", "no-url", "bad-detail", "placeholder-in-part", "placeholder-in-string",
        "int"])
def test_malformed_parts(content, param, message):
    err = refused([{"role": "user", "content": content}])
    assert err.param == param and message in err.message


def test_local_files_only_inside_the_allowed_dir(tmp_path):
    root = tmp_path / "media"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "a.png").write_bytes(PNG)
    (tmp_path / "secret.png").write_bytes(PNG)
    (root / "link.png").symlink_to(tmp_path / "secret.png")
    options = MediaOptions(allowed_local_dir=root)
    _, images = parse_chat_images(chat(str(root / "sub" / "a.png"), f"file://{root}/sub/a%2Epng"), options)
    assert [im.source for im in images] == [f"file:{root}/sub/a.png", f"file:{root}/sub/a.png"]
    assert images[0].content_hash == images[1].content_hash == hashlib.sha256(PNG).hexdigest()
    for escape in (f"{root}/sub/../../secret.png", f"file://{root}/../secret.png", str(root / "link.png")):
        err = refused(chat(escape), options)
        assert err.param == "messages[0].content[0].image_url"
        assert f"is outside the allowed local media directory {root}" in err.message
    err = refused(chat(str(root / "missing.png")), options)
    assert err.message == f"cannot read image file {root}/missing.png: No such file or directory"
    err = refused(chat(str(root / "sub" / "a.png")), MediaOptions(allowed_local_dir=root, max_image_bytes=100))
    assert err.message == f"image file {root}/sub/a.png is {len(PNG)} bytes, over the limit of 100 bytes"
    err = refused(chat("file://otherhost/x.png"), options)
    assert err.message == "file URL on another host 'otherhost'"


def test_remote_fetch_when_allowed():
    """A server on 127.0.0.1 (no network needed): fetched when allowed, byte limit and
    HTTP errors refused."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path.split("?")[0] != "/cat.png":
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(PNG)))
            self.end_headers()
            self.wfile.write(PNG)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        _, images = parse_chat_images(chat(f"{base}/cat.png?x=1"), MediaOptions(allow_remote=True))
        assert images[0].data == PNG and images[0].source == f"{base}/cat.png"
        err = refused(chat(f"{base}/cat.png"), MediaOptions(allow_remote=True, max_image_bytes=100))
        assert err.message == f"image at {base}/cat.png is over the limit of 100 bytes"
        err = refused(chat(f"{base}/dog.png"), MediaOptions(allow_remote=True))
        assert err.message == (f"cannot fetch image {base}/dog.png: Client error '404 Not Found'"
                               f" for url '{base}/dog.png'")
    finally:
        server.shutdown()
        server.server_close()
