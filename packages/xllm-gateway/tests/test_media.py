"""Image inputs (xllm.gateway.media): image_url parts from data: URLs and allow-listed http(s) URLs
(a loopback HTTP server of the module), every bad input a 400 naming its field, content hashes, and
the model's image processor (oracle: HF transformers' Qwen2-VL processor and its smart_resize)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import random
import struct
import threading
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from PIL import Image

from xllm.gateway.media.images import decode_image, load_images, pixel_hash
from xllm.gateway.media.limits import AllowedMediaDomains, MediaLimits, allowed_media_domains, media_limits
from xllm.gateway.media.parts import ImagePart, image_parts, parse_image_part
from xllm.gateway.media.preprocess import ImageProcessors, preprocess
from xllm.gateway.openai.errors import APIError

LIMITS = MediaLimits()
NO_REMOTE = AllowedMediaDomains()
LOOPBACK = AllowedMediaDomains.of(["127.0.0.1"])


# ---- helpers ---------------------------------------------------------------------------------------------


def noise(width: int, height: int, seed: int = 0, mode: str = "RGB") -> Image.Image:
    bands = len(mode)
    return Image.frombytes(mode, (width, height), random.Random(seed).randbytes(width * height * bands))


def palette_image(width: int, height: int, seed: int = 0) -> Image.Image:
    """An RGB image of 16 colours (a GIF keeps it exactly)."""
    colours = [tuple(random.Random(seed + c).randbytes(3)) for c in range(16)]
    rnd = random.Random(seed)
    img = Image.new("RGB", (width, height))
    img.putdata([colours[rnd.randrange(16)] for _ in range(width * height)])
    return img


def encode(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    if fmt == "WEBP":
        kw.setdefault("lossless", True)
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def data_url(raw: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(raw).decode()}"


def messages(*urls: str, detail: str | None = None) -> list[dict]:
    """One user message: a text part, then an image part per URL."""
    parts: list[dict] = [{"type": "text", "text": "What is this?"}]
    for url in urls:
        image = {"url": url} if detail is None else {"url": url, "detail": detail}
        parts.append({"type": "image_url", "image_url": image})
    return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": parts}]


def load(*urls: str, limits: MediaLimits = LIMITS, allow: AllowedMediaDomains = NO_REMOTE, detail=None):
    return asyncio.run(load_images(image_parts(messages(*urls, detail=detail)), limits, allow))


def refused(*urls: str, **kw) -> APIError:
    with pytest.raises(APIError) as info:
        load(*urls, **kw)
    err = info.value
    assert err.status == 400 and err.type == "invalid_request_error", err.body()
    assert err.message.startswith(f"Invalid '{err.param}'"), err.body()
    return err


def png_header_only(width: int, height: int, idat: bytes = b"") -> bytes:
    """A PNG whose IHDR declares ``width`` x ``height`` (1-bit grey) and whose IDAT holds ``idat``."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


# ---- data: URLs ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt, mime", [("PNG", "image/png"), ("WEBP", "image/webp"), ("GIF", "image/gif")])
def test_lossless_formats_decode_to_the_same_pixels(fmt, mime):
    original = palette_image(13, 7)
    (img,) = load(data_url(encode(original, fmt), mime))
    assert img.format == fmt and img.size == (13, 7) and img.image.mode == "RGB"
    assert img.image.tobytes() == original.tobytes()
    assert img.hash == pixel_hash(original)
    assert img.where == "messages[1].content[1]" and img.detail == "auto"


def test_jpeg_decodes_with_its_lossy_pixels():
    original = noise(16, 8)
    raw = encode(original, "JPEG", quality=90)
    (img,) = load(data_url(raw, "image/jpeg"), detail="low")
    assert (img.format, img.size, img.detail) == ("JPEG", (16, 8), "low")
    assert img.image.tobytes() == Image.open(io.BytesIO(raw)).convert("RGB").tobytes()  # Pillow's own decode


def test_gif_gives_its_first_frame():
    first, second = palette_image(6, 5, seed=1), palette_image(6, 5, seed=2)
    raw = encode(first, "GIF", save_all=True, append_images=[second])
    assert Image.open(io.BytesIO(raw)).n_frames == 2
    (img,) = load(data_url(raw, "image/gif"))
    assert img.image.tobytes() == first.tobytes()


def test_transparency_is_composited_onto_white_as_hf_does():
    from transformers.image_transforms import convert_to_rgb

    rgba = noise(9, 4, seed=3, mode="RGBA")
    (img,) = load(data_url(encode(rgba, "PNG"), "image/png"))
    assert img.image.tobytes() == convert_to_rgb(rgba, return_numpy=True).tobytes()


def test_several_images_keep_their_order_and_fields():
    a, b = palette_image(4, 4, seed=1), palette_image(5, 3, seed=2)
    got = load(data_url(encode(a, "PNG"), "image/png"), data_url(encode(b, "WEBP"), "image/webp"))
    assert [g.size for g in got] == [(4, 4), (5, 3)]
    assert [g.where for g in got] == ["messages[1].content[1]", "messages[1].content[2]"]


# ---- content hash ----------------------------------------------------------------------------------------


def test_identical_pixels_hash_alike_and_different_pixels_do_not():
    img = palette_image(8, 6)
    png, webp = encode(img, "PNG"), encode(img, "WEBP")
    assert png != webp
    changed = img.copy()
    changed.putpixel((3, 2), tuple(255 - c for c in img.getpixel((3, 2))))
    transposed = Image.frombytes("RGB", (6, 8), img.tobytes())  # the same bytes, another shape
    got = load(data_url(png, "image/png"), data_url(webp, "image/webp"), data_url(encode(changed, "PNG"), "image/png"),
               data_url(encode(transposed, "PNG"), "image/png"))
    assert got[0].hash == got[1].hash == pixel_hash(img)
    assert len({got[0].hash, got[2].hash, got[3].hash}) == 3
    assert len(got[0].hash) == 64  # BLAKE2b-256, hex


# ---- bad images: each a 400 naming the field --------------------------------------------------------------

URL_FIELD = "messages[1].content[1].image_url.url"


def test_truncated_png_is_a_400():
    raw = encode(noise(64, 64), "PNG")
    err = refused(data_url(raw[: len(raw) // 2], "image/png"))
    assert (err.param, err.code) == (URL_FIELD, "invalid_image")


def test_decompression_bomb_is_refused_from_its_header():
    bomb = png_header_only(50000, 50000, zlib.compress(b"\0" * 10000, 9))
    assert len(bomb) < 200
    err = refused(data_url(bomb, "image/png"))
    assert (err.param, err.code) == (URL_FIELD, "image_too_large")


def test_pixel_limit_is_checked_before_decoding():
    # 2000 x 2000 is below Pillow's own bomb guard; the IDAT holds nothing, so a decode would say "truncated":
    # the pixel limit answers first
    err = refused(data_url(png_header_only(2000, 2000), "image/png"), limits=MediaLimits(max_image_pixels=1_000_000))
    assert (err.param, err.code) == (URL_FIELD, "image_too_large") and "2000x2000" in err.message
    assert load(data_url(encode(noise(20, 10), "PNG"), "image/png"), limits=MediaLimits(max_image_pixels=200))


def test_wrong_mime_type_is_a_400():
    err = refused(data_url(encode(noise(4, 4), "PNG"), "image/jpeg"))
    assert (err.param, err.code) == (URL_FIELD, "invalid_image_format") and "PNG" in err.message


@pytest.mark.parametrize("url, code", [
    ("data:image/bmp;base64,Qk0=", "invalid_image_format"),  # not one of the four formats
    ("data:image/png,rawbytes", "invalid_image_url"),  # not base64
    ("data:image/png;base64,@@@@", "invalid_image_url"),  # bad base64
    ("data:image/png;base64," + base64.b64encode(b"not an image at all").decode(), "invalid_image_format"),
    ("data:image/png;base64," + base64.b64encode(encode(noise(4, 4), "BMP")).decode(), "invalid_image_format"),
])
def test_bad_data_urls_are_400s(url, code):
    err = refused(url)
    assert (err.param, err.code) == (URL_FIELD, code)
    assert "base64," not in err.message or len(err.message) < 200  # the payload is not echoed back


def test_too_many_images_is_a_400_before_any_is_loaded():
    good = data_url(encode(noise(2, 2), "PNG"), "image/png")
    # the first part would be refused (no remote fetch); the count is checked first and names the third part
    err = refused("http://example.com/a.png", good, good, limits=MediaLimits(max_images=2))
    assert (err.param, err.code) == ("messages[1].content[3]", "too_many_images")
    assert len(load(good, good, limits=MediaLimits(max_images=2))) == 2


def test_too_many_bytes_is_a_400():
    raw = encode(noise(64, 64), "PNG")
    err = refused(data_url(raw, "image/png"), limits=MediaLimits(max_image_bytes=len(raw) - 1))
    assert (err.param, err.code) == (URL_FIELD, "image_too_large")
    assert load(data_url(raw, "image/png"), limits=MediaLimits(max_image_bytes=len(raw)))


@pytest.mark.parametrize("url", ["file:///etc/passwd", "ftp://127.0.0.1/a.png", "gopher://127.0.0.1/",
                                 "javascript:alert(1)", "/relative/a.png"])
def test_other_schemes_are_refused(url):
    for allow in (NO_REMOTE, LOOPBACK):
        err = refused(url, allow=allow)
        assert (err.param, err.code) == (URL_FIELD, "invalid_image_url"), err.body()


@pytest.mark.parametrize("part, param", [
    ({"type": "image_url", "image_url": {"url": "data:,", "detail": "ultra"}}, "image_url.detail"),
    ({"type": "image_url", "image_url": {"url": ""}}, "image_url.url"),
    ({"type": "image_url", "image_url": {"url": 5}}, "image_url.url"),
    ({"type": "image_url", "image_url": {"url": "data:,", "size": 1}}, "image_url.size"),
    ({"type": "image_url", "image_url": None}, "image_url"),
    ({"type": "image_url", "image_url": {"url": "data:,"}, "x": 1}, "x"),
])
def test_malformed_parts_name_their_field(part, param):
    with pytest.raises(APIError) as info:
        parse_image_part(part, "messages[0].content[2]")
    assert info.value.status == 400 and info.value.param == f"messages[0].content[2].{param}"


def test_parts_are_found_in_order_and_string_urls_accepted():
    msgs = [{"role": "user", "content": "text only"},
            {"role": "user", "content": [{"type": "image_url", "image_url": "data:image/png;base64,AA=="},
                                         {"type": "text", "text": "x"},
                                         {"type": "image_url", "image_url": {"url": "https://h/a", "detail": "high"}}]}]
    assert image_parts(msgs) == [ImagePart("data:image/png;base64,AA==", "auto", "messages[1].content[0]"),
                                 ImagePart("https://h/a", "high", "messages[1].content[2]")]


def test_random_bytes_never_escape_as_another_error():
    rnd = random.Random(7)
    part = ImagePart("data:", "auto", "messages[0].content[0]")
    png = encode(noise(8, 8), "PNG")
    for _ in range(30):
        raw = bytearray(png)
        for _ in range(4):
            raw[rnd.randrange(8, len(raw))] = rnd.randrange(256)
        try:
            decode_image(part, bytes(raw), "image/png", LIMITS)
        except APIError as exc:
            assert exc.status == 400 and exc.param == "messages[0].content[0].image_url.url"


# ---- remote URLs: a loopback server ------------------------------------------------------------------------

PICTURE = palette_image(12, 9, seed=5)
PICTURE_PNG = encode(PICTURE, "PNG")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"
    release: threading.Event  # set by the fixture: the /hang route waits on it

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        port = self.server.server_address[1]
        routes = {
            "/img.png": (200, {"Content-Type": "image/png", "Content-Length": str(len(PICTURE_PNG))}, PICTURE_PNG),
            "/mislabelled": (200, {"Content-Type": "image/jpeg"}, PICTURE_PNG),
            "/no-type": (200, {}, PICTURE_PNG),
            "/redirect-same": (302, {"Location": "/img.png"}, b""),
            "/redirect-away": (302, {"Location": f"http://localhost:{port}/img.png"}, b""),
            "/redirect-file": (302, {"Location": "file:///etc/passwd"}, b""),
            "/redirect-loop": (302, {"Location": "/redirect-loop"}, b""),
            "/redirect-bad": (302, {"Location": "http://h:abc/"}, b""),  # an invalid port
            "/redirect-empty": (302, {}, b""),
            "/big-declared": (200, {"Content-Length": str(10 * len(PICTURE_PNG))}, PICTURE_PNG * 10),
            "/big-undeclared": (200, {}, PICTURE_PNG * 10),  # no length: read until the server closes
            "/missing": (404, {}, b"not here"),
        }
        if self.path == "/hang":
            self.release.wait(30)
            return
        status, headers, body = routes.get(self.path, (404, {}, b""))
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.end_headers()
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the client stopped reading at its cap
            self.wfile.write(body)


@pytest.fixture(scope="module")
def server():
    release = threading.Event()
    handler = type("Handler", (_Handler,), {"release": release})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    release.set()
    httpd.shutdown()
    httpd.server_close()
    thread.join(10)


def test_an_allowed_url_is_fetched(server):
    got = load(f"{server}/img.png", f"{server}/no-type", f"{server}/redirect-same", allow=LOOPBACK)
    assert [g.hash for g in got] == [pixel_hash(PICTURE)] * 3
    assert got[0].image.tobytes() == PICTURE.tobytes() and got[0].format == "PNG"


def test_remote_fetch_needs_the_allow_list(server):
    err = refused(f"{server}/img.png")  # no --allowed-media-domains
    assert (err.param, err.code) == (URL_FIELD, "image_url_not_allowed")
    err = refused(f"{server}/img.png", allow=AllowedMediaDomains.of(["localhost"]))  # an IP literal, not listed
    assert (err.param, err.code) == (URL_FIELD, "image_url_not_allowed") and "IP address" in err.message
    err = refused("https://example.com/a.png", allow=LOOPBACK)
    assert (err.param, err.code) == (URL_FIELD, "image_url_not_allowed") and "example.com" in err.message
    err = refused(server.replace("http://", "http://user@") + "/img.png", allow=LOOPBACK)
    assert (err.param, err.code) == (URL_FIELD, "image_url_not_allowed")


@pytest.mark.parametrize("path, code", [("/redirect-away", "image_url_not_allowed"),
                                        ("/redirect-file", "invalid_image_url"),
                                        ("/redirect-loop", "image_fetch_failed"),
                                        ("/redirect-bad", "image_fetch_failed"),
                                        ("/redirect-empty", "image_fetch_failed"),
                                        ("/missing", "image_fetch_failed"),
                                        ("/mislabelled", "invalid_image_format"),
                                        ("/big-declared", "image_too_large"),
                                        ("/big-undeclared", "image_too_large")])
def test_bad_remote_images_are_400s(server, path, code):
    limits = MediaLimits(max_image_bytes=3 * len(PICTURE_PNG))
    err = refused(f"{server}{path}", allow=LOOPBACK, limits=limits)
    assert (err.param, err.code) == (URL_FIELD, code), err.body()


def test_a_slow_server_times_out(server):
    err = refused(f"{server}/hang", allow=LOOPBACK, limits=MediaLimits(fetch_timeout_s=0.3))
    assert (err.param, err.code) == (URL_FIELD, "image_fetch_failed") and "0.3 s" in err.message


def test_an_unreachable_host_is_a_400():
    import socket

    with socket.socket() as s:  # a loopback port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    err = refused(f"http://127.0.0.1:{port}/a.png", allow=LOOPBACK)
    assert (err.param, err.code) == (URL_FIELD, "image_fetch_failed")


# ---- limits and flags ----------------------------------------------------------------------------------------


def test_flags_build_the_limits_and_allow_list():
    from xllm.gateway.cli import build_parser

    args = build_parser().parse_args(["serve", "--allowed-media-domains", "Images.Example.com.,cdn.example.org",
                                      "--allowed-media-domains", "10.0.0.7", "--max-image-mib", "0.5",
                                      "--max-image-pixels", "1000", "--max-images-per-request", "2",
                                      "--media-fetch-timeout-s", "2.5"])
    assert media_limits(args) == MediaLimits(max_image_bytes=512 * 1024, max_image_pixels=1000, max_images=2,
                                             fetch_timeout_s=2.5)
    allow = allowed_media_domains(args)
    assert allow.hosts == {"images.example.com", "cdn.example.org", "10.0.0.7"}
    assert allow.allows("IMAGES.example.com") and not allow.allows("sub.images.example.com")
    defaults = build_parser().parse_args(["serve"])
    assert media_limits(defaults) == MediaLimits() and not allowed_media_domains(defaults).enabled


@pytest.mark.parametrize("bad", ["http://a.com", "a.com/x", "a.com:80", "u@a.com"])
def test_allow_list_takes_bare_host_names(bad):
    with pytest.raises(ValueError, match="bare host names"):
        AllowedMediaDomains.of([bad])


@pytest.mark.parametrize("kwargs", [{"max_images": 0}, {"max_image_bytes": -1}, {"fetch_timeout_s": 0},
                                    {"max_image_pixels": True}])
def test_bad_limits(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        MediaLimits(**kwargs)


# ---- preprocessing: the model's image processor -----------------------------------------------------------

QWEN2_VL_PROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor", "do_resize": True, "do_rescale": True, "do_normalize": True,
    "do_convert_rgb": True, "rescale_factor": 1 / 255, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
    "min_pixels": 3136, "max_pixels": 50176, "size": {"shortest_edge": 3136, "longest_edge": 50176},
    "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2vl")
    (path / "preprocessor_config.json").write_text(json.dumps(QWEN2_VL_PROCESSOR))
    return path


def test_preprocess_gives_hf_token_counts(model_dir):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil, smart_resize

    sizes = [(30, 20), (100, 60), (640, 480), (57, 300)]  # below min_pixels, small, above max_pixels, tall
    images = load(*(data_url(encode(noise(w, h, seed=i), "PNG"), "image/png") for i, (w, h) in enumerate(sizes)))
    processors = ImageProcessors()
    got = preprocess(images, model_dir, processors)
    expected = []
    for w, h in sizes:
        rh, rw = smart_resize(h, w, factor=28, min_pixels=3136, max_pixels=50176)
        expected.append((rh // 14) * (rw // 14) // 4)
    assert got.tokens == expected
    assert got.grid_thw == [(1, rh // 14, rw // 14) for rh, rw in
                            (smart_resize(h, w, factor=28, min_pixels=3136, max_pixels=50176) for w, h in sizes)]
    hf = Qwen2VLImageProcessorPil(**{k: v for k, v in QWEN2_VL_PROCESSOR.items() if k != "image_processor_type"})
    ref = hf(images=[im.image for im in images], return_tensors="np")
    assert got.pixel_values.shape == ref["pixel_values"].shape == (4 * sum(expected), 3 * 2 * 14 * 14)
    assert abs(got.pixel_values - ref["pixel_values"]).max() < 1e-6
    assert got.hashes == [im.hash for im in images]
    assert processors.get(model_dir) is processors.get(str(model_dir))  # loaded once per directory


def test_preprocess_names_an_image_the_processor_refuses(model_dir):
    square, thin = encode(noise(8, 8), "PNG"), encode(noise(1, 300), "PNG")  # 1 x 300: aspect ratio past 200
    images = load(data_url(square, "image/png"), data_url(thin, "image/png"))
    with pytest.raises(APIError) as info:
        preprocess(images, model_dir, ImageProcessors())
    assert info.value.status == 400 and info.value.param == "messages[1].content[2].image_url.url"
