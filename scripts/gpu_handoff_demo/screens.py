"""What the simulated VMs show on their screens (``Tower.set_screen``): PNG
frames that ``virsh screenshot`` on the simulated tower saves as they are.

The GPU node shows a text console, as a headless k3s node does: its login
prompt while it works, and the kernel's hung-task report while it plays a
ghost (the story of ``custom_components/gpu_handoff/health.py``: a module
load hung at boot, so no pod sandbox ever comes up). A gaming station shows
a game. Frames are drawn with Pillow (a Home Assistant dependency) in the
console's own size, 720x400 (VGA text mode, as QEMU's screendump of a
console has it).
"""

from __future__ import annotations

from pathlib import Path
import zlib

from PIL import Image, ImageDraw, ImageFont

SIZE = (720, 400)
# Big enough to read on a dashboard card a third of a screen wide: 60
# columns; the lines stay clear of the card's name at the bottom.
CONSOLE_FONT = "DejaVuSansMono.ttf"
CONSOLE_SIZE = 20
LINE_HEIGHT = 24
GREY = (170, 170, 170)
WHITE = (255, 255, 255)


def _font(size: int) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    """A monospaced font where the system has DejaVu, else Pillow's own."""
    try:
        return ImageFont.truetype(CONSOLE_FONT, size)
    except OSError:
        return ImageFont.load_default(size)


def _console(lines: list[tuple[str, tuple[int, int, int]]]) -> Image.Image:
    image = Image.new("RGB", SIZE, (0, 0, 0))
    draw = ImageDraw.Draw(image)
    font = _font(CONSOLE_SIZE)
    for row, (text, colour) in enumerate(lines):
        draw.text((8, 6 + row * LINE_HEIGHT), text, font=font, fill=colour)
    return image


def working_console(hostname: str) -> Image.Image:
    """A node that booted and works: its login prompt."""
    return _console(
        [
            (f"Debian GNU/Linux 13 {hostname} tty1", GREY),
            ("", GREY),
            (f"{hostname} login: _", GREY),
        ]
    )


def ghost_console(hostname: str) -> Image.Image:
    """A node whose br_netfilter load hung at boot: Ready to the cluster,
    and no pod sandbox comes up (the kernel says why, on the console)."""
    return _console(
        [
            (f"Debian GNU/Linux 13 {hostname} tty1", GREY),
            ("", GREY),
            (f"{hostname} login:", GREY),
            ("[  245.771932] INFO: task modprobe:612 blocked for", WHITE),
            ("               more than 122 seconds.", WHITE),
            ("[  245.772071] task:modprobe state:D pid:612", WHITE),
            ("[  245.772090] Call Trace:", WHITE),
            ("[  245.772140]  rwsem_down_write_slowpath+0x2b1/0x6c0", WHITE),
            ("[  245.772152]  register_pernet_subsys+0x1f/0x50", WHITE),
            ("[  245.772160]  br_netfilter_init+0x16/0xff0", WHITE),
            ("[  245.772171]  do_one_initcall+0x5b/0x320", WHITE),
            (f"{hostname} login: _", GREY),
        ]
    )


def game(title: str) -> Image.Image:
    """A game's frame: a dusk sky, mountains, and the player's score."""
    width, height = SIZE
    image = Image.new("RGB", SIZE)
    draw = ImageDraw.Draw(image)
    # Each station its own sky, from its name.
    hue = zlib.crc32(title.encode("utf-8")) % 60
    for y in range(height):
        shade = y / height
        draw.line(
            [(0, y), (width, y)],
            fill=(
                int(40 + 180 * shade),
                int(30 + hue + 60 * shade),
                int(110 - 60 * shade),
            ),
        )
    draw.ellipse((470, 150, 590, 270), fill=(255, 214, 120))
    draw.polygon(
        [
            (0, 300),
            (120, 190),
            (210, 260),
            (330, 150),
            (470, 280),
            (590, 200),
            (720, 290),
            (720, 400),
            (0, 400),
        ],
        fill=(36, 28, 58),
    )
    draw.polygon(
        [
            (0, 350),
            (160, 290),
            (300, 340),
            (460, 300),
            (720, 360),
            (720, 400),
            (0, 400),
        ],
        fill=(18, 14, 30),
    )
    hud = _font(20)
    draw.text((16, 12), "SCORE 004200", font=hud, fill=WHITE)
    draw.text((width - 16, 12), "LEVEL 3", font=hud, fill=WHITE, anchor="ra")
    return image


def save(image: Image.Image, path: Path) -> Path:
    """``image`` as a PNG at ``path`` (written whole, then moved into place:
    the simulator may be reading the old one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    image.save(partial, format="PNG")
    partial.replace(path)
    return path
