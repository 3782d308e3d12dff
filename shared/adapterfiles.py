"""The LoRA adapter contract between the trainer (writer) and inference nodes (readers).

A version published with `WeightVersion.format == "lora"` is the folder
`{run.dir}/weights/v{N:06d}/` in peft's layout:
- `adapter_model.safetensors`: tensors `base_model.model.<module>.lora_A.weight` (r, in) and
  `...lora_B.weight` (out, r) for each adapted linear layer `<module>` of the base model;
- `adapter_config.json`: peft's LoraConfig (r, lora_alpha, target_modules, ...).
`location` is the folder; `checksum` is the sha256 of the manifest: one `sha256sum`-style
line per file (`<hex>  <name>\n`, config first). One hash on the wire covers both files.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from .errors import WeightsError
from .weightfiles import sha256_file

FORMAT_LORA = "lora"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_FILES = (ADAPTER_CONFIG, ADAPTER_WEIGHTS)  # in manifest order
PEFT_PREFIX = "base_model.model."  # what peft puts before a module's name in the saved tensors


def manifest_line(name: str, sha256: str) -> bytes:
    return f"{sha256}  {name}\n".encode()


def adapter_checksum(file_sums: dict[str, str]) -> str:
    """The announced checksum of an adapter whose files have these sha256s (name -> hex)."""
    return hashlib.sha256(
        b"".join(manifest_line(name, file_sums[name]) for name in ADAPTER_FILES)
    ).hexdigest()


def verify_adapter(folder: str | Path, checksum: str) -> None:
    """WeightsError whose text starts with the reason (missing, checksum) unless the adapter
    folder holds both files and their manifest hashes to the announced checksum."""
    folder = Path(folder)
    sums = {}
    for name in ADAPTER_FILES:
        path = folder / name
        if not path.is_file():
            raise WeightsError(f"missing: adapter file {path} does not exist")
        sums[name] = sha256_file(path)
    actual = adapter_checksum(sums)
    if actual != checksum.lower():
        raise WeightsError(
            f"checksum: adapter {folder} hashes to {actual} ({', '.join(f'{n} {s}' for n, s in sums.items())}), "
            f"announced {checksum}"
        )
