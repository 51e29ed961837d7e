"""`score_stats.json` in a reward model folder that ppo-train-rm wrote: the mean, standard deviation
and count of its scores on the training pairs (both sides). With reward.model.normalize=true, PPO's
running normalisation starts from them instead of from its first batch."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

SCORE_STATS = "score_stats.json"


def write_score_stats(folder: Path, stats: dict[str, float]) -> None:
    """folder/score_stats.json from {"mean", "std", "count"}."""
    (folder / SCORE_STATS).write_text(json.dumps({k: stats[k] for k in ("mean", "std", "count")}, indent=1) + "\n")


def read_score_stats(folder: Path) -> Optional[dict[str, float]]:
    """{"mean", "std", "count"} of folder/score_stats.json, None where the folder has none. ValueError
    naming the file when it holds no finite mean and std and a positive count."""
    path = Path(folder) / SCORE_STATS
    if not path.is_file():
        return None
    try:
        stats = json.loads(path.read_text())
        mean, std, count = float(stats["mean"]), float(stats["std"]), int(stats["count"])
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a score statistics file ({type(e).__name__}: {e}); expected "
                         '{"mean": ..., "std": ..., "count": ...}, or remove it') from None
    if not (math.isfinite(mean) and math.isfinite(std) and std >= 0 and count > 0):
        raise ValueError(f"{path}: mean {mean}, std {std}, count {count} cannot start a normalisation; remove the file")
    return {"mean": mean, "std": std, "count": count}
