"""Draft trees (DDTree, Ringel & Romano): the best-first tree one v1 draft pass proposes, and
the walk that verifies it in one target pass.

A v1 draft gives each block slot its own distribution in one pass (the slots are independent
marginals). A path t1..td scores the product of its slots' probabilities, and the tree keeps
the `budget` best-scoring paths, prefix-closed: a child never scores above its parent and a
lower-ranked sibling never above a higher-ranked one, so a heap that holds, for every node
taken, its first child and its next sibling always holds the next best prefix.

Rows: row 0 is the root (the last committed token, the block's slot 0); every other row is one
node, and parents precede their children. Everything here is a pure function of lists.

Exactness: the tree is a deterministic function of the tokens so far, and the walk emits at
every node the target's own token there (its argmax, or a sample from its distribution), moving
to the child that holds it. The emitted tokens are therefore exactly those the target would
have decoded alone; the tree only decides how many of them one pass yields.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np


@dataclass(frozen=True)
class Tree:
    """A draft tree in rows (row 0: the root), parents before children.

    Args:
        tokens: per row, its token (row 0: the root's).
        parents: per row, its parent's row (-1 for the root).
        depths: per row, its depth (0 for the root): the slot its token fills.
        ranks: per row, its token's rank in its slot (0: the draft's argmax; 0 for the root;
            -1: a grafted row, e.g. the context lookup's).
    """

    tokens: list[int]
    parents: list[int]
    depths: list[int]
    ranks: list[int]
    _children: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        kids: dict[tuple[int, int], int] = {}
        for row in range(1, len(self.tokens)):
            kids.setdefault((self.parents[row], self.tokens[row]), row)
        object.__setattr__(self, "_children", kids)

    def __len__(self) -> int:
        """Rows, the root included (the width of the verify pass)."""
        return len(self.tokens)

    def child(self, row: int, token: int) -> int | None:
        """The child of `row` holding `token`, if the tree has one."""
        return self._children.get((row, token))

    def visible(self) -> np.ndarray:
        """(rows, rows) bool: row i may attend to row j iff j is i or one of its ancestors."""
        n = len(self)
        out = np.zeros((n, n), dtype=bool)
        for row in range(n):
            if row:
                out[row] = out[self.parents[row]]
            out[row, row] = True
        return out

    def paths(self) -> list[mx.array]:
        """Per row, the tokens from depth 1 down to it (the root's: none): what precedes the
        row's prediction after the committed tokens."""
        out: list[list[int]] = [[]]
        for row in range(1, len(self)):
            out.append(out[self.parents[row]] + [self.tokens[row]])
        return [mx.array(p, dtype=mx.int32) for p in out]

    def best_continuation(self, row: int) -> list[int]:
        """Rows below `row` along first children (each the best-scoring child)."""
        first: dict[int, int] = {}
        for r in range(len(self) - 1, 0, -1):  # the lowest row of a parent's children wins
            first[self.parents[r]] = r
        out = []
        while row in first:
            row = first[row]
            out.append(row)
        return out

    def off_main(self, path: list[int]) -> int:
        """How many rows of `path` (from the root) lie off the draft's argmax path."""
        for i, row in enumerate(path):
            if self.ranks[row]:
                return len(path) - i
        return 0


def build_tree(root: int, ids: list[list[int]], logp: list[list[float]], budget: int) -> Tree:
    """The `budget` likeliest draft prefixes as a tree, in the order best-first takes them.

    Args:
        root: the last committed token (row 0).
        ids: per slot 1..S, the draft's candidate tokens, best first (distinct per slot).
        logp: their log-probabilities, in the same order (non-increasing).
        budget: nodes besides the root (fewer when the slots offer fewer paths).
    """
    tokens, parents, depths, ranks, score = [root], [-1], [0], [0], [0.0]
    heap: list[tuple[float, int, int, int, int]] = []  # (-score, tiebreak, parent, depth, rank)
    tick = 0

    def push(parent: int, depth: int, rank: int):
        nonlocal tick
        if depth <= len(ids) and rank < len(ids[depth - 1]):
            s = score[parent] + logp[depth - 1][rank]
            heapq.heappush(heap, (-s, tick, parent, depth, rank))
            tick += 1

    push(0, 1, 0)
    while heap and len(tokens) <= budget:
        neg, _, parent, depth, rank = heapq.heappop(heap)
        row = len(tokens)
        tokens.append(int(ids[depth - 1][rank]))
        parents.append(parent)
        depths.append(depth)
        ranks.append(rank)
        score.append(-neg)
        push(row, depth + 1, 0)  # its first child
        push(parent, depth, rank + 1)  # its next sibling
    return Tree(tokens, parents, depths, ranks)


def graft(tree: Tree, path: list[int]) -> Tree:
    """`tree` with `path` (tokens after the root) added where the tree lacks it, as new rows at
    the end (rank -1: not one of the draft's guesses). Parents still precede children."""
    tokens, parents = list(tree.tokens), list(tree.parents)
    depths, ranks = list(tree.depths), list(tree.ranks)
    added: dict[tuple[int, int], int] = {}
    row = 0
    for depth, token in enumerate(path, 1):
        nxt = tree.child(row, token) if row < len(tree) else None
        nxt = added.get((row, token)) if nxt is None else nxt
        if nxt is None:
            nxt = added[(row, token)] = len(tokens)
            tokens.append(int(token))
            parents.append(row)
            depths.append(depth)
            ranks.append(-1)
        row = nxt
    return Tree(tokens, parents, depths, ranks) if added else tree


def walk(tree: Tree, answer: list[int]) -> tuple[list[int], int]:
    """Follow the target through the tree.

    Args:
        answer: per row, the target's token after that row's path (its argmax, or one sample
            from its distribution there).

    Returns:
        (rows from the root to the last accepted node, the bonus token after it).
    """
    path = [0]
    while (nxt := tree.child(path[-1], answer[path[-1]])) is not None:
        path.append(nxt)
    return path, answer[path[-1]]
