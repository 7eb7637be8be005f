//! The device mesh: how the world's ranks split into tensor-parallel (TP), data-parallel (DP) and
//! pipeline-parallel (PP) groups.
//!
//! Ranks are laid out as Megatron and neuronx-distributed lay them out: TP fastest, then DP, then
//! PP (`rank = (pp · dp_size + dp) · tp_size + tp`). TP ranks are contiguous, so with
//! `--nproc-per-node` a multiple of TP a TP group — which talks every layer — stays inside one
//! machine, and only the once-per-step DP traffic crosses machines.

use crate::{KilnError, Result};

/// The sizes of the three axes; `tp × dp × pp` is the world size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mesh {
    pub tp: usize,
    pub dp: usize,
    pub pp: usize,
}

/// One rank's place on each axis.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Coords {
    pub tp: usize,
    pub dp: usize,
    pub pp: usize,
}

impl Mesh {
    /// The mesh of `world` ranks with the given TP and PP sizes; DP takes the rest
    /// (DP = world / (TP × PP), as NxD derives it).
    pub fn new(world: usize, tp: usize, pp: usize) -> Result<Self> {
        if tp == 0 || pp == 0 {
            return Err(KilnError::Config(
                "--tensor-parallel-size and --pipeline-parallel-size must be at least 1".into(),
            ));
        }
        let Some(per_replica) = tp.checked_mul(pp) else {
            return Err(KilnError::Config(format!(
                "--tensor-parallel-size {tp} × --pipeline-parallel-size {pp} is more processes \
                 than can be counted"
            )));
        };
        if !world.is_multiple_of(per_replica) {
            return Err(KilnError::Config(format!(
                "the world of {world} processes does not divide into groups of \
                 --tensor-parallel-size {tp} × --pipeline-parallel-size {pp}; launch a multiple \
                 of {per_replica} processes"
            )));
        }
        Ok(Self {
            tp,
            dp: world / per_replica,
            pp,
        })
    }

    pub fn world(&self) -> usize {
        self.tp * self.dp * self.pp
    }

    pub fn coords(&self, rank: usize) -> Coords {
        Coords {
            tp: rank % self.tp,
            dp: rank / self.tp % self.dp,
            pp: rank / (self.tp * self.dp),
        }
    }

    pub fn rank_of(&self, c: Coords) -> usize {
        (c.pp * self.dp + c.dp) * self.tp + c.tp
    }

    /// The TP groups: ranks that hold the shards of one model replica (one stage of it).
    pub fn tp_groups(&self) -> Vec<Vec<usize>> {
        self.groups(|c, i| Coords { tp: i, ..c }, self.tp, |c| c.tp == 0)
    }

    /// The DP groups: ranks that hold the same shard and average its gradients.
    pub fn dp_groups(&self) -> Vec<Vec<usize>> {
        self.groups(|c, i| Coords { dp: i, ..c }, self.dp, |c| c.dp == 0)
    }

    /// The PP groups: ranks that hold the successive stages of one replica's shard.
    pub fn pp_groups(&self) -> Vec<Vec<usize>> {
        self.groups(|c, i| Coords { pp: i, ..c }, self.pp, |c| c.pp == 0)
    }

    /// One group per rank whose coordinate on the axis is 0, each listing the ranks that differ
    /// from it only on that axis.
    fn groups(
        &self,
        along: impl Fn(Coords, usize) -> Coords,
        len: usize,
        first: impl Fn(Coords) -> bool,
    ) -> Vec<Vec<usize>> {
        (0..self.world())
            .map(|r| self.coords(r))
            .filter(|&c| first(c))
            .map(|c| (0..len).map(|i| self.rank_of(along(c, i))).collect())
            .collect()
    }
}

impl std::fmt::Display for Mesh {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "tp={} dp={} pp={}", self.tp, self.dp, self.pp)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tp_ranks_are_contiguous_and_every_axis_partitions_the_world() {
        let m = Mesh::new(8, 2, 2).unwrap();
        assert_eq!(m.dp, 2);
        assert_eq!(
            m.tp_groups(),
            vec![vec![0, 1], vec![2, 3], vec![4, 5], vec![6, 7]]
        );
        assert_eq!(
            m.dp_groups(),
            vec![vec![0, 2], vec![1, 3], vec![4, 6], vec![5, 7]]
        );
        assert_eq!(
            m.pp_groups(),
            vec![vec![0, 4], vec![1, 5], vec![2, 6], vec![3, 7]]
        );
        for r in 0..8 {
            assert_eq!(m.rank_of(m.coords(r)), r);
        }
        for groups in [m.tp_groups(), m.dp_groups(), m.pp_groups()] {
            let mut all: Vec<usize> = groups.concat();
            all.sort();
            assert_eq!(all, (0..8).collect::<Vec<_>>());
        }
    }

    #[test]
    fn a_world_that_does_not_divide_is_one_sentence() {
        let e = Mesh::new(6, 4, 1).unwrap_err().to_string();
        assert!(
            e.contains("world of 6") && e.contains("--tensor-parallel-size 4"),
            "{e}"
        );
        assert_eq!(Mesh::new(6, 3, 1).unwrap().dp, 2);
        let e = Mesh::new(4, 2, usize::MAX).unwrap_err().to_string();
        assert!(e.contains("more processes than can be counted"), "{e}");
    }
}
