"""Where a rank sits in the world of a parallel layout: its (pp, dp, tp) coordinates and its sub-meshes.

The ranks are laid out row-major over ``(pp, dp, tp)`` (tensor-parallel ranks adjacent, as Megatron-LM and
torchtitan place them: the chattiest groups on the nearest ranks), the order ``init_device_mesh`` numbers a mesh
of that shape.  ``RankMesh.build`` makes the device mesh of the degrees above 1 (a dimension of size 1 has nothing
to say); ``group(name)`` is that dimension's process group, None where its degree is 1.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from batchlab.config.parallel import Layout

DIMS = ("pp", "dp", "tp")


def coordinates(layout: Layout, rank: int) -> dict[str, int]:
    """Rank ``rank``'s index along each dimension (row-major over pp, dp, tp)."""
    tp = rank % layout.tp
    dp = (rank // layout.tp) % layout.dp
    pp = rank // (layout.tp * layout.dp)
    return dict(pp=pp, dp=dp, tp=tp)


def sizes(layout: Layout) -> dict[str, int]:
    return dict(pp=layout.pp, dp=layout.dp, tp=layout.tp)


@dataclass
class RankMesh:
    layout: Layout
    rank: int
    mesh: object = None  # the DeviceMesh over the dimensions whose degree is above 1; None with one rank
    names: tuple[str, ...] = field(default_factory=tuple)

    @classmethod
    def build(cls, layout: Layout, rank: int, device_type: str) -> "RankMesh":
        names = tuple(n for n in DIMS if sizes(layout)[n] > 1)
        if not names:
            return cls(layout, rank)
        from torch.distributed.device_mesh import init_device_mesh
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily():  # the mesh holds real rank numbers, also under a fake-tensor trace
            mesh = init_device_mesh(device_type, tuple(sizes(layout)[n] for n in names), mesh_dim_names=names)
        return cls(layout, rank, mesh, names)

    @property
    def coords(self) -> dict[str, int]:
        return coordinates(self.layout, self.rank)

    def sub(self, name: str):
        """The 1-D mesh of dimension ``name``; None where its degree is 1."""
        return self.mesh[name] if name in self.names else None

    def group(self, name: str):
        sub = self.sub(name)
        return None if sub is None else sub.get_group()
