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
