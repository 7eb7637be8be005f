//! ZeRO stage 1 (`--zero-1`): the optimizer state is sharded over the data-parallel group.
//!
//! The parameters that train are laid end to end, in path order, as one flat vector; data-parallel
//! rank `r` owns its [`chunk_range`] of it (a chunk may cut through a parameter). Per step: the
//! gradients are reduce-scattered (each rank receives the average of its chunk only), the global
//! norm is summed from every rank's chunk, AdamW updates the owned chunk with the moments only this
//! rank keeps, and the updated chunks are all-gathered so every rank holds the whole model again.
//! Gradients stay whole between micro-batches (stage 1, as DeepSpeed's and NxD's ZeRO-1); what
//! shrinks is the two AdamW moments, to `1 / dp` of their size per rank.

use std::ops::Range;

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

use super::collectives::{chunk_range, Collectives};
use crate::Result;

/// Where one parameter's owned values sit: `within` the parameter's flat values and `at` the
/// rank's chunk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OwnedSegment {
    pub path: String,
    pub within: Range<usize>,
    pub at: Range<usize>,
}

/// The flat layout of the trained parameters and this rank's chunk of it.
#[derive(Debug, Clone)]
pub struct ZeroPartition {
    /// Every trained parameter's path, offset in the flat vector and length, in path order.
    params: Vec<(String, usize, usize)>,
    total: usize,
    rank: usize,
    size: usize,
}

impl ZeroPartition {
    /// The layout of parameters `sizes` (path → number of values, in path order: a `BTreeMap`'s
    /// order) over `size` data-parallel ranks, seen from `rank`.
    pub fn new<'a>(
        sizes: impl IntoIterator<Item = (&'a str, usize)>,
        rank: usize,
        size: usize,
    ) -> Self {
        let mut total = 0;
        let params = sizes
            .into_iter()
            .map(|(p, n)| {
                let at = total;
                total += n;
                (p.to_string(), at, n)
            })
            .collect::<Vec<(String, usize, usize)>>();
        debug_assert!(
            params.windows(2).all(|w| w[0].0 < w[1].0),
            "parameters are laid out in path order"
        );
        Self {
            params,
            total,
            rank,
            size,
        }
    }

    /// The number of values laid out.
    pub fn total(&self) -> usize {
        self.total
    }

    /// Rank `r`'s chunk of the flat vector.
    pub fn chunk_of(&self, r: usize) -> Range<usize> {
        chunk_range(self.total, self.size, r)
    }

    /// This rank's chunk.
    pub fn chunk(&self) -> Range<usize> {
        self.chunk_of(self.rank)
    }

    /// Every rank's chunk length (the counts of the all-gather that puts the model back together).
    pub fn counts(&self) -> Vec<usize> {
        (0..self.size).map(|r| self.chunk_of(r).len()).collect()
    }

    /// The parameter values this rank owns, parameter by parameter, in chunk order.
    pub fn owned(&self) -> Vec<OwnedSegment> {
        let chunk = self.chunk();
        self.params
            .iter()
            .filter_map(|(path, at, n)| {
                let start = chunk.start.max(*at);
                let end = chunk.end.min(at + n);
                (start < end).then(|| OwnedSegment {
                    path: path.clone(),
                    within: start - at..end - at,
                    at: start - chunk.start..end - chunk.start,
                })
            })
            .collect()
    }

    /// Where parameter `path` sits in the flat vector (the parameters are in path order).
    pub fn range_of(&self, path: &str) -> Option<Range<usize>> {
        let i = self
            .params
            .binary_search_by(|(p, _, _)| p.as_str().cmp(path))
            .ok()?;
        let (_, at, n) = &self.params[i];
        Some(*at..at + n)
    }
}

/// ZeRO-1's two collectives over the data-parallel group.
pub struct Zero1<B: Backend> {
    group: std::sync::Arc<dyn Collectives<B>>,
}

// By hand: a derive would ask `B: Clone`; the group is shared.
impl<B: Backend> Clone for Zero1<B> {
    fn clone(&self) -> Self {
        Self {
            group: self.group.clone(),
        }
    }
}

impl<B: Backend> Zero1<B> {
    pub fn new(group: std::sync::Arc<dyn Collectives<B>>) -> Self {
        Self { group }
    }

    pub fn rank(&self) -> usize {
        self.group.rank()
    }

    pub fn size(&self) -> usize {
        self.group.size()
    }

    /// This rank's chunk of the average of every rank's flat gradients.
    pub fn average_chunk(&self, flat: Tensor<B, 1>) -> Result<Tensor<B, 1>> {
        let size = self.group.size() as f64;
        Ok(self.group.reduce_scatter(flat)?.div_scalar(size))
    }

    /// The whole flat vector back from every rank's updated chunk.
    pub fn gather(&self, chunk: Tensor<B, 1>, partition: &ZeroPartition) -> Result<Tensor<B, 1>> {
        self.group.all_gather_v(chunk, &partition.counts())
    }

    /// Sums host values over the group (the norm's partial sums, the loss).
    pub fn sum_host(&self, values: Vec<f32>) -> Result<Vec<f32>> {
        self.group.sum_host(values)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cut_through_parameters_and_cover_the_vector() {
        let sizes = [("a", 5), ("b", 2), ("c", 6)];
        let mut seen = vec![0; 13];
        for rank in 0..3 {
            let p = ZeroPartition::new(sizes.iter().map(|&(p, n)| (p, n)), rank, 3);
            let chunk = p.chunk();
            let mut covered = 0;
            for s in p.owned() {
                let base = p.range_of(&s.path).unwrap().start;
                for (i, w) in s.within.clone().enumerate() {
                    seen[base + w] += 1;
                    assert_eq!(chunk.start + s.at.start + i, base + w);
                }
                covered += s.at.len();
            }
            assert_eq!(covered, chunk.len());
        }
        assert!(seen.iter().all(|&c| c == 1), "{seen:?}");
        let p = ZeroPartition::new(sizes.iter().map(|&(p, n)| (p, n)), 1, 3);
        // Rank 1 owns values 5..9: all of b and the first two of c.
        assert_eq!(
            p.owned(),
            vec![
                OwnedSegment {
                    path: "b".into(),
                    within: 0..2,
                    at: 0..2
                },
                OwnedSegment {
                    path: "c".into(),
                    within: 0..2,
                    at: 2..4
                },
            ]
        );
        assert_eq!(p.counts(), vec![5, 4, 4]);
    }
}
