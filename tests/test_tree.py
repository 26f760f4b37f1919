import pytest
import torch

from hf_treespec.tree import DraftTree


def small_tree() -> DraftTree:
    #      0
    #    1   2
    #   3 4   5
    #   6
    tree = DraftTree.root(9)
    tree = tree.add_children(torch.tensor([0, 0]), torch.tensor([11, 12]), torch.log(torch.tensor([0.6, 0.3])))
    tree = tree.add_children(torch.tensor([1, 1, 2]), torch.tensor([13, 14, 15]), torch.log(torch.tensor([0.5, 0.4, 0.9])))
    return tree.add_children(torch.tensor([3]), torch.tensor([16]), torch.log(torch.tensor([0.7])))


def test_ancestor_mask_and_paths():
    tree = small_tree()
    anc = tree.ancestor_mask()
    assert anc[6].nonzero().squeeze(-1).tolist() == [0, 1, 3, 6]
    assert anc[5].nonzero().squeeze(-1).tolist() == [0, 2, 5]
    assert anc.diagonal().all()
    assert tree.paths()[6].tolist() == [9, 11, 13, 16]
    assert tree.paths()[2].tolist() == [9, 12, -1, -1]
    assert tree.depth.tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert torch.allclose(tree.scores[6], torch.log(torch.tensor(0.6 * 0.5 * 0.7)))


def test_select_keeps_structure_and_uids():
    tree = small_tree()
    sub = tree.select(torch.tensor([0, 2, 5, 1]))
    assert sub.tokens.tolist() == [9, 11, 12, 15]
    assert sub.parents.tolist() == [-1, 0, 0, 2]
    assert sub.uids.tolist() == [0, 1, 2, 5]
    assert sub.path_to(3).tolist() == [0, 2, 3]


def test_select_rejects_orphans():
    import pytest

    with pytest.raises(ValueError, match="parent"):
        small_tree().select(torch.tensor([0, 3]))


def test_chain_detection_and_children():
    tree = small_tree()
    assert not tree.is_chain()
    assert tree.children(1).tolist() == [3, 4]
    assert tree.num_children().tolist() == [2, 2, 1, 1, 0, 0, 0]
    chain = DraftTree.root(1).add_children(torch.tensor([0]), torch.tensor([2]), torch.zeros(1))
    assert chain.is_chain()


# ------------------------------------------------------------------------------ randomised vs a brute-force walk
def random_tree(gen: torch.Generator, size: int) -> tuple[DraftTree, list[float]]:
    """A random tree grown by random batches of ``add_children`` / ``add_path`` (parents before children), and each
    node's own draft log-prob as it was added (root: 0)."""
    tree, own = DraftTree.root(int(torch.randint(0, 50, (1,), generator=gen))), [0.0]
    while tree.num_nodes < size:
        if torch.rand(1, generator=gen) < 0.3:
            parent = int(torch.randint(0, tree.num_nodes, (1,), generator=gen))
            length = int(torch.randint(1, 4, (1,), generator=gen))
            logprobs = -torch.rand(length, generator=gen)
            tree = tree.add_path(parent, torch.randint(0, 50, (length,), generator=gen), logprobs)
        else:
            count = int(torch.randint(1, 5, (1,), generator=gen))
            parents = torch.randint(0, tree.num_nodes, (count,), generator=gen)
            logprobs = -torch.rand(count, generator=gen)
            tree = tree.add_children(parents, torch.randint(0, 50, (count,), generator=gen), logprobs)
        own += logprobs.tolist()
    return tree, own


def walk_up(parents: list[int], node: int) -> list[int]:
    """Node indices root -> ``node`` by following parent pointers one by one."""
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


@pytest.mark.parametrize("seed", range(20))
def test_vectorised_structure_matches_a_brute_force_walk(seed):
    gen = torch.Generator().manual_seed(seed)
    tree, own = random_tree(gen, int(torch.randint(1, 40, (1,), generator=gen)))
    parents, tokens = tree.parents.tolist(), tree.tokens.tolist()
    n = tree.num_nodes
    anc = tree.ancestor_mask()
    paths = tree.paths()
    assert anc.shape == (n, n) and paths.shape == (n, tree.max_depth + 1)
    for node in range(n):
        path = walk_up(parents, node)
        assert all(parents[child] == parent for parent, child in zip(path, path[1:]))
        assert anc[node].nonzero().squeeze(-1).tolist() == path
        assert tree.path_to(node).tolist() == path
        assert int(tree.depth[node]) == len(path) - 1
        assert paths[node].tolist() == [tokens[v] for v in path] + [-1] * (tree.max_depth + 1 - len(path))
        assert tree.children(node).tolist() == [v for v in range(n) if parents[v] == node]
        assert float(tree.scores[node]) == pytest.approx(sum(own[v] for v in path), abs=1e-5)
    assert tree.num_children().tolist() == [sum(p == v for p in parents) for v in range(n)]

    # select: a random set closed under parents keeps every kept node's path, tokens and uid
    keep = {0}
    for node in range(1, n):
        if parents[node] in keep and torch.rand(1, generator=gen) < 0.7:
            keep.add(node)
    kept = sorted(keep)
    sub = tree.select(torch.tensor(kept))
    assert sub.uids.tolist() == [int(tree.uids[v]) for v in kept]
    sub_parents = sub.parents.tolist()
    for new, old in enumerate(kept):
        assert [kept[v] for v in walk_up(sub_parents, new)] == walk_up(parents, old)
        assert sub.paths()[new, : int(sub.depth[new]) + 1].tolist() == paths[old, : int(tree.depth[old]) + 1].tolist()
    if n > 1:  # a set that is not closed under parents is refused
        orphan = max(range(1, n), key=lambda v: int(tree.depth[v]))
        if int(tree.depth[orphan]) > 1:
            with pytest.raises(ValueError, match="parent"):
                tree.select(torch.tensor([0, orphan]))


@pytest.mark.parametrize("seed", range(5))
def test_incremental_mask_equals_a_rebuild(seed):
    """The mask grown with each append / select equals the one rebuilt from parents for the same structure."""
    gen = torch.Generator().manual_seed(100 + seed)
    tree, _ = random_tree(gen, 30)
    keep = torch.zeros(tree.num_nodes, dtype=torch.bool)
    keep[0] = True
    for node in range(1, tree.num_nodes):  # a random set closed under parents
        keep[node] = bool(keep[tree.parents[node]]) and bool(torch.rand(1, generator=gen) < 0.8)
    tree = tree.select(keep)
    by_hand = DraftTree(tokens=tree.tokens.clone(), parents=tree.parents.clone(), depth=tree.depth.clone(),
                        scores=tree.scores.clone())
    assert "anc" in tree._cache and "anc" not in by_hand._cache
    assert torch.equal(tree.ancestor_mask(), by_hand.ancestor_mask())


def test_trees_live_on_the_host():
    with pytest.raises(ValueError, match="host bookkeeping"):
        DraftTree(tokens=torch.zeros(1, dtype=torch.long, device="meta"), parents=torch.full((1,), -1),
                  depth=torch.zeros(1, dtype=torch.long), scores=torch.zeros(1))


def test_packed_copy_round_trips_mixed_dtypes():
    from hf_treespec.kv.tree_kv import pack, unpack

    tensors = (torch.tensor([[True, False, True]]), torch.arange(5)[None], torch.tensor([1.5, -2.0]),
               torch.tensor([7, 8], dtype=torch.int32), torch.zeros(0, dtype=torch.long))
    back = unpack(pack(tensors).clone(), tensors)
    for a, b in zip(tensors, back):
        assert a.dtype == b.dtype and torch.equal(a, b)
