"""A strict PNG reader for the screenshot tests (stdlib only).

It checks what a browser relies on (the signature, every chunk's CRC, IHDR
first and IEND last, the compressed data's integrity) and undoes the five
row filters of filter method 0, so pictures written by other encoders (QEMU's
libpng, libvirt's test driver) compare pixel for pixel with the agent's.
Only 8-bit RGB and RGBA, not interlaced: what screens are saved as.
"""

from __future__ import annotations

from dataclasses import dataclass
import zlib

SIGNATURE = b"\x89PNG\r\n\x1a\n"
_CHANNELS = {2: 3, 6: 4}  # colour type: samples per pixel


class PngError(ValueError):
    """Not a PNG this reader accepts."""


@dataclass(frozen=True)
class Picture:
    """A decoded PNG: its size and its pixels as RGB rows, top to bottom."""

    width: int
    height: int
    rgb: bytes


def chunks(data: bytes) -> list[tuple[bytes, bytes]]:
    """(type, body) of every chunk, after checking the signature and CRCs."""
    if not data.startswith(SIGNATURE):
        raise PngError("no PNG signature")
    out = []
    pos = len(SIGNATURE)
    while pos < len(data):
        if pos + 12 > len(data):
            raise PngError("truncated chunk")
        length = int.from_bytes(data[pos : pos + 4], "big")
        kind = data[pos + 4 : pos + 8]
        body = data[pos + 8 : pos + 8 + length]
        crc = data[pos + 8 + length : pos + 12 + length]
        if len(body) != length or len(crc) != 4:
            raise PngError(f"truncated {kind!r} chunk")
        if zlib.crc32(kind + body) & 0xFFFFFFFF != int.from_bytes(crc, "big"):
            raise PngError(f"bad CRC in {kind!r}")
        out.append((kind, body))
        pos += 12 + length
    if not out or out[0][0] != b"IHDR" or out[-1] != (b"IEND", b""):
        raise PngError("IHDR must come first and IEND last")
    return out


def size_of(data: bytes) -> tuple[int, int]:
    """(width, height) from the header, without decoding the pixels."""
    header = chunks(data)[0][1]
    return int.from_bytes(header[0:4], "big"), int.from_bytes(header[4:8], "big")


def _paeth(a: int, b: int, c: int) -> int:
    p = a + b - c
    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
    if pa <= pb and pa <= pc:
        return a
    return b if pb <= pc else c


def _unfilter(kind: int, line: bytearray, prior: bytes, bpp: int) -> None:
    if kind == 0:
        return
    if kind == 2:
        line[:] = bytes((x + y) & 0xFF for x, y in zip(line, prior, strict=True))
        return
    for i in range(len(line)):
        a = line[i - bpp] if i >= bpp else 0
        b = prior[i]
        c = prior[i - bpp] if i >= bpp else 0
        if kind == 1:
            line[i] = (line[i] + a) & 0xFF
        elif kind == 3:
            line[i] = (line[i] + (a + b) // 2) & 0xFF
        elif kind == 4:
            line[i] = (line[i] + _paeth(a, b, c)) & 0xFF
        else:
            raise PngError(f"unknown filter type {kind}")


def decode(data: bytes) -> Picture:
    """The picture in ``data``; PngError for anything this reader refuses."""
    parts = chunks(data)
    header = parts[0][1]
    width = int.from_bytes(header[0:4], "big")
    height = int.from_bytes(header[4:8], "big")
    depth, colour, compression, method, interlace = header[8:13]
    if depth != 8 or colour not in _CHANNELS or compression or method or interlace:
        raise PngError(f"unsupported header {header.hex()}")
    if width == 0 or height == 0:
        raise PngError("empty picture")
    bpp = _CHANNELS[colour]
    try:
        raw = zlib.decompress(b"".join(body for kind, body in parts if kind == b"IDAT"))
    except zlib.error as err:
        raise PngError(f"bad image data: {err}") from err
    stride = width * bpp
    if len(raw) != height * (stride + 1):
        raise PngError(f"{len(raw)} bytes of rows for {width}x{height}")
    prior = bytes(stride)
    rows = []
    for y in range(height):
        start = y * (stride + 1)
        line = bytearray(raw[start + 1 : start + 1 + stride])
        _unfilter(raw[start], line, prior, bpp)
        prior = bytes(line)
        if bpp == 4:
            del line[3::4]
        rows.append(bytes(line))
    return Picture(width, height, b"".join(rows))


def ppm_pixels(ppm: bytes) -> tuple[int, int, bytes]:
    """(width, height, RGB pixels) of a PPM as QEMU writes it ("P6\\nW H\\n255\\n")."""
    magic, size, maxval, pixels = ppm.split(b"\n", 3)
    width, height = (int(value) for value in size.split())
    if magic != b"P6" or maxval != b"255" or len(pixels) != width * height * 3:
        raise PngError("not a PPM as QEMU writes it")
    return width, height, pixels
