"""NeMo-RL's sliding-puzzle game (its `env.sliding_puzzle_game`, examples/configs/grpo_sliding_puzzle.yaml) as a
posttrain environment, with the same rules, texts and rewards.

    rollout.multi_turn.environment=posttrain.envs.sliding_puzzle:SlidingPuzzle
    rollout.multi_turn.environment_kwargs={size: 3, shuffle_moves: 10, max_moves: 30}

Each row is a puzzle: its `extra_info.seed` (`posttrain preprocess sliding-puzzle` writes rows of seeds; any other
row: its prompt's text) draws, as NeMo-RL's data generator does, a size from 2 to `size` and an odd number of
random moves from 1 to `shuffle_moves` away from the solved grid (0 is the empty cell, bottom right when solved).
The first message is NeMo-RL's instructions with the board. The model answers with `<action>X</action>` (the
last one in its turn counts): up / down / left / right slide a tile into the empty cell, `slide ROW COL` the tile
at that place, `view` shows the board. Reward 1 when the grid is solved (the conversation ends), 0 otherwise; a
turn without an action, or `max_moves` moves made, ends it. Environment messages come as user messages (NeMo-RL's
role "environment" is no chat-template role).
"""

from __future__ import annotations

import random
import zlib

from posttrain.envs.base import Step

MOVES = {"up": (1, 0), "down": (-1, 0), "left": (0, 1), "right": (0, -1)}  # where the tile that moves comes from


def generate(size: int, shuffle_moves: int, rng: random.Random) -> list[list[int]]:
    grid = [[r * size + c + 1 for c in range(size)] for r in range(size)]
    grid[size - 1][size - 1] = 0
    r, c = size - 1, size - 1
    for _ in range(shuffle_moves):
        nr, nc = rng.choice([(r + dr, c + dc) for dr, dc in ((0, 1), (1, 0), (0, -1), (-1, 0))
                             if 0 <= r + dr < size and 0 <= c + dc < size])
        grid[r][c], grid[nr][nc] = grid[nr][nc], grid[r][c]
        r, c = nr, nc
    return grid


def solved(grid: list[list[int]]) -> bool:
    size = len(grid)
    flat = [v for row in grid for v in row]
    return flat == list(range(1, size * size)) + [0]


def render(grid: list[list[int]]) -> str:
    size = len(grid)
    digits = len(str(size * size - 1))
    lines = ["\n", "  +" + "-" * (digits + 2) * size + "+"]
    for i, row in enumerate(grid):
        lines.append(f"{i + 1} |" + "".join(" " * (digits + 2) if v == 0 else f" {v:>{digits}} " for v in row) + "|")
    lines.append("  +" + "-" * (digits + 2) * size + "+")
    lines.append("    " + "".join(f"{i + 1:^{digits + 2}}" for i in range(size)))
    return "\n".join(lines)


def instructions(grid: list[list[int]]) -> str:
    size = len(grid)
    return (f"\n===== SLIDING PUZZLE =====\nArrange the {size}x{size} grid by sliding tiles into the empty space.\n"
            f"- The goal is to arrange numbers from 1 to {size * size - 1} in order\n"
            "- Use 'up', 'down', 'left', 'right' to slide in that direction\n"
            "- Use 'view' to see the current state of the board\n\n"
            f"Current Board State:\n{render(grid)}\n\n"
            f"Reach the goal state where numbers are ordered 1 through {size ** 2 - 1} with the empty space (0) at "
            "the bottom right.\nValid actions: 'up', 'down', 'left', 'right', or 'slide row col' (e.g., 'slide 1 2').\n"
            "After thinking, output your chosen action on a new line starting with '<action></action>' like this:\n"
            "<action>your_action</action>\nIf you just want to see the board, output <action>view</action>\n"
            "Think carefully step-by-step before acting.")


def last_action(text: str) -> str | None:
    lower = text.lower()
    start = lower.rfind("<action>")
    if start < 0:
        return None
    end = lower.find("</action>", start + len("<action>"))
    return text[start + len("<action>"):end].strip() if end >= 0 else None


class SlidingPuzzle:
    def __init__(self, size: int = 3, shuffle_moves: int = 10, max_moves: int = 30):
        if size < 2 or shuffle_moves < 1 or max_moves < 1:
            raise ValueError(f"need size >= 2, shuffle_moves >= 1, max_moves >= 1; got {size}, {shuffle_moves}, "
                             f"{max_moves}")
        self.size, self.shuffle_moves, self.max_moves = size, shuffle_moves, max_moves

    def reset(self, row: dict) -> list[dict]:
        seed = (row.get("extra_info") or {}).get("seed")
        if seed is None:
            seed = zlib.crc32(str(row.get("prompt")).encode())
        rng = random.Random(int(seed))
        size = rng.randint(2, self.size)
        moves = rng.randint(1, self.shuffle_moves)
        self.grid = generate(size, moves + 1 if moves % 2 == 0 else moves, rng)
        self.moves = 0
        return [{"role": "user", "content": instructions(self.grid)}]

    def step(self, text: str) -> Step:
        if self.moves >= self.max_moves:
            return self._say(f"<error>Maximum moves ({self.max_moves}) reached.</error>", done=True)
        action = last_action(text)
        if action is None:
            return self._say(f"<environment>\n{render(self.grid)}\n\nInvalid response format no move made. Try "
                             "<action></action> like this: <action>your_action</action></environment>", done=True)
        if action == "view":
            return self._say(f"<environment>\n{render(self.grid)}\n\nViewing the board. No move made.</environment>")
        response, moved = self._move(action)
        self.moves += moved
        if moved and solved(self.grid):
            return Step([], 1.0, True, {"solved": 1.0, "moves": self.moves})
        return self._say(f"<environment>\n{response}\n</environment>")

    def _move(self, action: str) -> tuple[str, bool]:
        size, grid = len(self.grid), self.grid
        er, ec = next((r, c) for r in range(size) for c in range(size) if grid[r][c] == 0)
        if action.startswith("slide "):
            try:
                _, r, c = action.split()
                r, c = int(r) - 1, int(c) - 1
            except ValueError:
                return "Invalid input format. Use: slide row col", False
            if not (0 <= r < size and 0 <= c < size):
                return f"Invalid position. Row/column must be between 1 and {size}.", False
            if abs(r - er) + abs(c - ec) != 1:
                return "Tile must be adjacent to the empty space.", False
            tile = grid[r][c]
            grid[er][ec], grid[r][c] = tile, 0
            return f"Slid tile {tile} into the empty space.", True
        if action in MOVES:
            dr, dc = MOVES[action]
            r, c = er + dr, ec + dc
            if not (0 <= r < size and 0 <= c < size):
                return f"Cannot slide {action}.", False
            tile = grid[r][c]
            grid[er][ec], grid[r][c] = tile, 0
            return f"Slid tile {tile} {action}.", True
        return "Unknown command. Type 'help' to see available commands.", False

    def _say(self, text: str, done: bool = False) -> Step:
        info = {"solved": 0.0, "moves": self.moves} if done else {}
        return Step([{"role": "user", "content": text + "\n"}], 0.0, done, info)
