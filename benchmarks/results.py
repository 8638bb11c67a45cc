"""The JSON file a kernel benchmark writes with -o: its rows, and what they were measured on."""
from __future__ import annotations

import datetime
import json

import torch


def write_json(path: str, rows: list, device: str, **extra) -> None:
    """{meta: date, device, torch and triton versions, `extra`; rows} to `path`, and one line saying so."""
    import triton   # after the caller chose the interpreter or not
    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                device=torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)",
                torch=torch.__version__, triton=triton.__version__, **extra)
    with open(path, "w") as fh:
        json.dump(dict(meta=meta, rows=rows), fh, indent=1)
    print(f"wrote {path}")
