"""A domain's screen as PNG, whatever format libvirt hands out.

libvirt before 9.0 hands out PPM (P6); this module checks its header and
converts it to PNG with the standard library alone, within bounds on size.
"""

from __future__ import annotations

import base64
import os
import re
import shutil
import tempfile
import zlib

from .config import Config
from .virsh import Virsh, cmd_screenshot
from .wire import ERR_SCREENSHOT_FAILED, ERR_TOO_LARGE, AgentError, JsonObj, reply_ok

# For the type checker only (see the package's docstring).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import IO, List, Tuple

MIME_PNG = "image/png"
# What `virsh screenshot` saves where libvirt is older than 9.0 or QEMU older
# than 7.1 (QEMU's screendump in its default format): browsers cannot show a
# PPM, so the agent sends it as a PNG.
MIME_PPM = "image/x-portable-pixmap"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# zlib's default level: within a few percent of level 9's size on a screen,
# in a fraction of its time.
PNG_LEVEL = 6
# A PPM header is "P6 WIDTH HEIGHT MAXVAL" and one whitespace byte (QEMU
# writes 15 bytes); Netpbm allows comments between the fields, not pages.
PPM_HEADER_MAX = 256
# The widest and tallest screen converted (QEMU's own limit on a display).
SCREEN_SIDE_MAX = 16384
# The largest PPM read: a 4K screen is 24 MiB of PPM, a 5K one 42 MiB. It is
# read in blocks, never whole; what is sent is bounded by screenshot_max_bytes.
PPM_MAX_BYTES = 64 << 20
# Rows are filtered and compressed this many bytes at a time.
PPM_BLOCK_BYTES = 1 << 20
_PPM_SPACE = rb"[ \t\n\r\v\f]"
# Between two fields: whitespace and comments ("#" to the end of the line).
_PPM_GAP = rb"(?:" + _PPM_SPACE + rb"|#[^\n\r]*[\n\r])+"
_PPM_HEADER = re.compile(rb"P6" + (_PPM_GAP + rb"([0-9]{1,7})") * 3 + _PPM_SPACE)


def parse_ppm_header(head: bytes, size: int) -> Tuple[int, int, int, int]:
    """(width, height, maxval, offset of the pixels) of a binary PPM of ``size``
    bytes whose first bytes are ``head``, as Netpbm defines the format.

    One image of 8-bit samples (maxval 1 to 255), exactly as many pixel bytes
    as the header says: anything else is refused, not guessed at.
    """
    found = _PPM_HEADER.match(head[:PPM_HEADER_MAX])
    if found is None:
        raise AgentError(
            ERR_SCREENSHOT_FAILED, "the screenshot is not a PPM this agent can read"
        )
    width, height, maxval = (int(value) for value in found.groups())
    if width == 0 or height == 0:
        raise AgentError(ERR_SCREENSHOT_FAILED, f"the PPM is empty ({width}x{height})")
    if width > SCREEN_SIDE_MAX or height > SCREEN_SIDE_MAX:
        raise AgentError(
            ERR_TOO_LARGE,
            f"the screen is {width}x{height}; at most {SCREEN_SIDE_MAX} pixels a side"
            " are read",
        )
    if not 0 < maxval < 256:
        raise AgentError(
            ERR_SCREENSHOT_FAILED,
            f"the PPM's maximum value is {maxval}; only 8-bit samples are read",
        )
    offset = found.end()
    if size != offset + width * height * 3:
        raise AgentError(
            ERR_SCREENSHOT_FAILED,
            f"the PPM is {size} bytes, not the {offset + width * height * 3}"
            f" its {width}x{height} header says",
        )
    return width, height, maxval, offset


def png_chunk(kind: bytes, body: bytes) -> bytes:
    crc = zlib.crc32(body, zlib.crc32(kind)) & 0xFFFFFFFF
    return len(body).to_bytes(4, "big") + kind + body + crc.to_bytes(4, "big")


def _too_large(size: int, limit: int, what: str = "") -> AgentError:
    return AgentError(
        ERR_TOO_LARGE,
        f"screenshot is {size} bytes{what}, more than screenshot_max_bytes={limit}",
    )


def png_from_ppm(handle: IO[bytes], size: int, limit: int) -> Tuple[bytes, int, int]:
    """The PPM in ``handle`` (``size`` bytes) as a PNG of at most ``limit``
    bytes, with its width and height.

    8-bit RGB, every row with filter type 0 (none): a screen compresses well
    as it is, and the tower spends no time choosing filters. The PPM is read
    and compressed a block of rows at a time, and the work stops as soon as
    the PNG would exceed ``limit``.
    """
    if size > PPM_MAX_BYTES:
        raise AgentError(
            ERR_TOO_LARGE,
            f"the PPM is {size} bytes; at most {PPM_MAX_BYTES} are converted",
        )
    width, height, maxval, offset = parse_ppm_header(handle.read(PPM_HEADER_MAX), size)
    handle.seek(offset)
    row = width * 3
    # Samples scaled to 0-255 where maxval is lower (values above maxval are
    # invalid in a PPM: they are shown at full intensity).
    scale = (
        None
        if maxval == 255
        else bytes(min(255, (v * 255 + maxval // 2) // maxval) for v in range(256))
    )
    rows_per_block = max(1, PPM_BLOCK_BYTES // row)
    squeeze = zlib.compressobj(PNG_LEVEL)
    parts: List[bytes] = []
    produced = 0
    done = 0
    while done < height:
        count = min(rows_per_block, height - done)
        pixels = handle.read(count * row)
        if len(pixels) != count * row:
            raise AgentError(ERR_SCREENSHOT_FAILED, "the PPM ended early")
        if scale is not None:
            pixels = pixels.translate(scale)
        view = memoryview(pixels)
        rows = b"\x00" + b"\x00".join(
            view[start : start + row] for start in range(0, len(pixels), row)
        )
        parts.append(squeeze.compress(rows))
        produced += len(parts[-1])
        if produced > limit:
            raise _too_large(produced, limit, " as PNG before its end")
        done += count
    parts.append(squeeze.flush())
    # 8-bit samples, RGB, deflate, filters of method 0, not interlaced.
    header = width.to_bytes(4, "big") + height.to_bytes(4, "big") + b"\x08\x02\0\0\0"
    png = b"".join(
        (
            PNG_SIGNATURE,
            png_chunk(b"IHDR", header),
            png_chunk(b"IDAT", b"".join(parts)),
            png_chunk(b"IEND", b""),
        )
    )
    if len(png) > limit:
        raise _too_large(len(png), limit, " as PNG")
    return png, width, height


def verb_screenshot(cfg: Config, domain: str) -> JsonObj:
    """The domain's screen as `virsh screenshot` saves it; a PPM (older
    libvirt or QEMU) is sent as a PNG. At most screenshot_max_bytes are sent."""
    virsh = Virsh(cfg)
    limit = cfg.screenshot_max_bytes
    tmpdir = tempfile.mkdtemp(prefix="gpu-handoff-shot-")
    try:
        target = os.path.join(tmpdir, "screen")
        result = virsh.run(cmd_screenshot(domain, target))
        if result.rc != 0:
            raise AgentError(ERR_SCREENSHOT_FAILED, result.error_text())
        match = re.search(r"with type of (\S+?)\.?$", result.out.strip())
        mime = match.group(1) if match else "application/octet-stream"
        with open(target, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            if mime == MIME_PPM:
                data, _width, _height = png_from_ppm(handle, size, limit)
                mime = MIME_PNG
            elif size > limit:
                raise _too_large(size, limit)
            else:
                data = handle.read(size)  # virsh has finished writing it
        return reply_ok(
            domain=domain,
            mime=mime,
            size=len(data),
            data=base64.b64encode(data).decode("ascii"),
        )
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
