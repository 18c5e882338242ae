"""`screenshot`: shows the model the screen of its task, an image drawn in-process (no
sandbox), for the toy visual tasks (envs.tasks.screens) and any task that names it.

A task's screen is a function of its id alone (`screen_for_task`): a white screen with a
grey title bar and one filled square of one of COLOURS, at a place and size drawn from a
generator seeded with the id. The task set reads its answer from the same function, so
the tool never sees `Task.answer`, and every worker, the warm start's demonstrations and
a test draw the same pixels for the same id.

Screens are twice as wide as high: the tiny-vl processor resizes an image's longest edge
to 224 pixels and cuts it into 112-pixel tiles, so a 2:1 screen is 2 tiles plus the whole
image (57 ids, 48 of them `<image>`) where a square one is 4 + 1 (94 ids, 80 `<image>`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from envs.tools.base import ToolResult, function_schema
from envs.types import Image, JsonObject

if TYPE_CHECKING:
    from envs.trajectory_env import TrajectoryEnv

# Far apart in RGB and in hue, so the answer never hinges on a shade.
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30), "green": (30, 160, 50), "blue": (40, 70, 220), "yellow": (240, 200, 20)}
BACKGROUND = (255, 255, 255)
TITLE_BAR = (200, 200, 200)
TITLE_BAR_PIXELS = 8
SCREEN_WIDTHS = (128, 160, 192)  # height = width // 2 (see the module docstring)
OBSERVATION_TEXT = "Screenshot:"


@dataclass(frozen=True, slots=True)
class Screen:
    """What a screen shows: its size, and the square's colour, top-left corner and side."""

    width: int
    height: int
    colour: str
    left: int
    top: int
    side: int

    def __post_init__(self) -> None:
        if self.colour not in COLOURS:
            raise ValueError(f"screen colour must be one of {', '.join(COLOURS)}, got {self.colour!r}")
        if not (0 <= self.left and self.left + self.side <= self.width
                and TITLE_BAR_PIXELS <= self.top and self.top + self.side <= self.height and self.side > 0):
            raise ValueError(f"the square ({self.side} px at {self.left},{self.top}) must lie inside the "
                             f"{self.width}x{self.height} screen, below its title bar")

    def render(self) -> Any:  # Any: a PIL.Image.Image (PIL is imported on use)
        """The screen as an RGB picture."""
        from PIL import Image as PILImage, ImageDraw

        picture = PILImage.new("RGB", (self.width, self.height), BACKGROUND)
        draw = ImageDraw.Draw(picture)
        draw.rectangle((0, 0, self.width - 1, TITLE_BAR_PIXELS - 1), fill=TITLE_BAR)
        draw.rectangle((self.left, self.top, self.left + self.side - 1, self.top + self.side - 1),
                       fill=COLOURS[self.colour])
        return picture

    def to_image(self) -> Image:
        """The screen as a PNG message part (lossless: the model sees exactly these pixels)."""
        return Image.from_pil(self.render())


def screen_for_task(task_id: str) -> Screen:
    """The screen of the task with this id; the same for the same id, in any process
    (random.Random seeds from a string through SHA-512, not the salted str hash)."""
    rng = random.Random(f"screenshot/{task_id}")
    width = rng.choice(SCREEN_WIDTHS)
    height = width // 2
    # At least 40% of the height: after the processor's resize the square covers several
    # 14-pixel patches of the whole-image tile, so its colour is visible in every tile cut.
    side = rng.randint(height * 2 // 5, (height - TITLE_BAR_PIXELS) * 4 // 5)
    return Screen(width=width, height=height, colour=rng.choice(sorted(COLOURS)),
                  left=rng.randint(0, width - side), top=rng.randint(TITLE_BAR_PIXELS, height - side),
                  side=side)


def screenshot_result(task_id: str) -> ToolResult:
    """What `screenshot` returns in the task with this id (the warm start's demonstrations
    show the model exactly this)."""
    return ToolResult(OBSERVATION_TEXT, images=(screen_for_task(task_id).to_image(),))


class ScreenshotTool:
    name = "screenshot"
    schema = function_schema("screenshot", "Take a screenshot of the screen and see it.", {})

    def __init__(self, env: "TrajectoryEnv") -> None:
        self._task_id = env.task.id

    async def execute(self, arguments: JsonObject) -> ToolResult:
        # Drawing and encoding a screen under 200x100 pixels takes about a millisecond:
        # fine on the event loop, so no thread.
        return screenshot_result(self._task_id)
