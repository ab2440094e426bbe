"""Seeds: drawn as torch draws them, derived so every process and run agrees.

Owns: :func:`draw_seed` (a base seed from a torch generator), :func:`derive_seed` (a seed from
integer parts, the same in every process and Python run) and :func:`epoch_permutation`. Never:
keeps state; the only outside state it reads is the torch generator it is given (or torch's
default one).
"""

from __future__ import annotations

import hashlib
import operator

import torch

__all__ = ["derive_seed", "draw_seed", "epoch_permutation"]

_SEED_BITS = 63
_SEED_PERSON = b"aioloader.seed"


def draw_seed(generator: torch.Generator | None = None) -> int:
    """A 64-bit seed drawn from ``generator`` (torch's default generator when None), as torch's
    DataLoader draws its base seed: ``torch.manual_seed`` makes it repeatable."""
    device = generator.device if generator is not None else None
    draw = torch.empty((), dtype=torch.int64, device=device)
    return int(draw.random_(generator=generator).item())


def derive_seed(*parts: int) -> int:
    """Derive a deterministic 63-bit seed from integer parts.

    The result depends only on the parts and their order, so it is the same in
    every process and Python run (it never uses ``hash()``). Typical parts are
    ``(base_seed, epoch)`` or ``(base_seed, epoch, batch_index)``.

    Args:
        *parts: Integers of any size and sign (anything accepted by
            ``operator.index``, such as numpy integers).

    Returns:
        An int in ``[0, 2**63)``, suitable for ``torch.Generator.manual_seed``.

    Raises:
        TypeError: If a part is not an integer.
    """
    digest = hashlib.blake2b(digest_size=8, person=_SEED_PERSON)
    for i, part in enumerate(parts):
        try:
            value = operator.index(part)
        except TypeError:
            raise TypeError(f"parts[{i}] must be an int, got {part!r}") from None
        # Length-prefixed signed encoding: unambiguous for any size and sign.
        size = max(16, (value.bit_length() + 8) // 8)
        digest.update(size.to_bytes(4, "little"))
        digest.update(value.to_bytes(size, "little", signed=True))
    return int.from_bytes(digest.digest(), "little") >> (64 - _SEED_BITS)


def epoch_permutation(length: int, base_seed: int, epoch: int) -> list[int]:
    """Return the seeded permutation of ``range(length)`` for an epoch."""
    generator = torch.Generator()
    generator.manual_seed(derive_seed(base_seed, epoch))
    order: list[int] = torch.randperm(length, generator=generator).tolist()
    return order
