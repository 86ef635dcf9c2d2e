"""Host bookkeeping of the paged KV cache: which pages of the shared pool each decode slot holds.

The pool has G groups of N pages of P tokens each (G = the number of devices the slots are split
over, so a slot's pages live on its own device). Slots are split into G equal consecutive groups
(slot s in group s // (S / G)) and a slot takes pages only from its group. Slot s's token at
position p lives in page `table[s, p // P]`, row p % P; table entries past the pages a slot holds
are N (out of range: writes there are dropped, reads masked). Pages are taken on demand, as a
sequence grows, and given back when it ends, so memory follows the live tokens rather than
slots x max_len. The engine decides when to grow; the batcher decides whom to preempt when a
group runs short (`shortfall`).

Pages are reference counted: `share` lets a slot hold the first pages of another slot of its
group (the prompt's K/V, written once, read by every sample of a prompt), and a page goes back to
the free list when its last holder releases it. Only pages no one writes again are shared (the
engine shares those wholly below a prompt's last token).
"""

from __future__ import annotations

import numpy as np


def pages_for(length: int, page_size: int) -> int:
    """ceil(length / page_size): pages covering positions [0, length)."""
    return -(-int(length) // page_size)


class PageTable:
    """Pages held per slot, free pages per group, and the `table` the device reads (module doc)."""

    def __init__(self, *, num_slots: int, groups: int, pages_per_group: int, page_size: int, pages_per_slot: int):
        if num_slots % groups:
            raise ValueError(
                f"paged KV cache: num_slots={num_slots} must split into {groups} equal "
                "page groups (one per device the slots are sharded over)"
            )
        if pages_per_group < pages_per_slot:
            raise ValueError(
                f"paged KV cache: {pages_per_group} pages per group cannot hold one sequence of "
                f"{pages_per_slot} pages (max_len / page_size); raise EngineConfig.num_pages"
            )
        self.groups, self.pages_per_group, self.page_size = groups, pages_per_group, page_size
        self.slots_per_group = num_slots // groups
        self.table = np.full((num_slots, pages_per_slot), pages_per_group, np.int32)
        self.held = np.zeros((num_slots,), np.int64)
        self._free = [list(range(pages_per_group - 1, -1, -1)) for _ in range(groups)]
        self._holders = np.zeros((groups, pages_per_group), np.int64)  # slots holding each page

    def group_of(self, slot: int) -> int:
        return int(slot) // self.slots_per_group

    def free_pages(self, group: int) -> int:
        return len(self._free[group])

    def missing(self, slot: int, length: int) -> int:
        """Pages slot `slot` still needs to cover positions [0, length) (0 if it has them)."""
        return max(0, pages_for(length, self.page_size) - int(self.held[slot]))

    def grow(self, slot: int, length: int) -> bool:
        """Give `slot` pages covering positions [0, length); False (and nothing taken) if its group
        has too few free pages."""
        need = self.missing(slot, length)
        free = self._free[self.group_of(slot)]
        if need > len(free):
            return False
        start = int(self.held[slot])
        for index in range(start, start + need):
            self.table[slot, index] = free.pop()
        self._holders[self.group_of(slot), self.table[slot, start : start + need]] = 1
        self.held[slot] += need
        return True

    def share(self, slot: int, source: int, count: int) -> None:
        """Let `slot` (holding no page) hold the first `count` pages of `source`, a slot of the
        same group: both read them, neither may write them again."""
        group = self.group_of(slot)
        if self.group_of(source) != group:
            raise ValueError(f"paged KV cache: slot {slot} (group {group}) cannot share the pages of slot {source}")
        if self.held[slot] or not 0 <= count <= self.held[source]:
            raise ValueError(
                f"paged KV cache: slot {slot} holds {self.held[slot]} pages and slot {source} "
                f"{self.held[source]}; cannot share {count}"
            )
        self.table[slot, :count] = self.table[source, :count]
        self._holders[group, self.table[slot, :count]] += 1
        self.held[slot] = count

    def release(self, slot: int) -> None:
        """Drop `slot`'s hold on its pages; those it was the last to hold return to its group."""
        held, group = int(self.held[slot]), self.group_of(slot)
        pages = self.table[slot, :held]
        self._holders[group, pages] -= 1
        self._free[group].extend(pages[::-1][self._holders[group, pages[::-1]] == 0].tolist())
        self.table[slot, :held] = self.pages_per_group
        self.held[slot] = 0

    def shared_pages(self) -> int:
        """Page holds beyond the first, over the pool: the pages sharing saves right now."""
        return int(np.maximum(self._holders - 1, 0).sum())

    def shortfall(self, needs: dict[int, int]) -> dict[int, int]:
        """Per group, pages missing to grow every slot in `needs` ({slot: length}) at once
        (groups with enough free pages are left out)."""
        wanted = np.zeros((self.groups,), np.int64)
        for slot, length in needs.items():
            wanted[self.group_of(slot)] += self.missing(slot, length)
        return {
            group: int(wanted[group]) - self.free_pages(group)
            for group in range(self.groups)
            if wanted[group] > self.free_pages(group)
        }
