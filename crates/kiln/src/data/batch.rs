//! Ordering examples into batches and padding them into tensors.

use rand::{rngs::StdRng, seq::SliceRandom, SeedableRng};

use super::tokenize::Encoded;

/// How a batch is padded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Padding {
    /// To the longest example in the batch (dynamic padding; the default).
    Longest,
    /// Always to this length (fixed shapes, as `padding="max_length"`).
    MaxLength(usize),
    /// To the longest example rounded up to a multiple of `multiple` (transformers'
    /// `pad_to_multiple_of`), never past `max` (the truncation length): a bounded set of shapes.
    MultipleOf { multiple: usize, max: usize },
}

/// `longest` rounded up to a multiple of `pad_to_multiple_of`, as TRL's collators round a batch's
/// length (`None` or 1: as it is).
pub fn round_to_multiple(longest: usize, pad_to_multiple_of: Option<usize>) -> usize {
    match pad_to_multiple_of {
        Some(m) if m > 1 => longest.div_ceil(m) * m,
        _ => longest,
    }
}

impl Padding {
    /// The length a batch whose longest example has `longest` tokens is padded to.
    pub fn padded_length(&self, longest: usize) -> usize {
        match *self {
            Padding::Longest => longest,
            Padding::MaxLength(n) => n.max(longest),
            // A multiple past the cap rounds to the cap (and cannot overflow).
            Padding::MultipleOf { multiple, max } => longest
                .checked_next_multiple_of(multiple.max(1))
                .map_or(max.max(longest), |t| t.min(max.max(longest))),
        }
    }
}

/// A padded batch of token ids on the host, row-major `[batch, seq]`.
#[derive(Debug, Clone, PartialEq)]
pub struct TextBatch {
    pub batch: usize,
    pub seq: usize,
    pub input_ids: Vec<i64>,
    /// 1 for real tokens, 0 for padding.
    pub attention_mask: Vec<i64>,
    pub token_type_ids: Vec<i64>,
}

/// Pads `examples` into one batch. Padding positions get `pad_id`, token type 0 and mask 0.
pub fn collate(examples: &[&Encoded], padding: Padding, pad_id: u32) -> TextBatch {
    let longest = examples
        .iter()
        .map(|e| e.input_ids.len())
        .max()
        .unwrap_or(1);
    let t = padding.padded_length(longest);
    let b = examples.len();
    let mut ids = vec![pad_id as i64; b * t];
    let mut types = vec![0i64; b * t];
    let mut mask = vec![0i64; b * t];
    for (row, e) in examples.iter().enumerate() {
        for (j, (&id, &ty)) in e.input_ids.iter().zip(&e.token_type_ids).enumerate() {
            ids[row * t + j] = id as i64;
            types[row * t + j] = ty as i64;
            mask[row * t + j] = 1;
        }
    }
    TextBatch {
        batch: b,
        seq: t,
        input_ids: ids,
        attention_mask: mask,
        token_type_ids: types,
    }
}

/// The order in which one epoch visits the examples: a permutation seeded by `(seed, epoch)`, so an
/// epoch's order never depends on what ran before it (which makes resuming exact).
///
/// With `group_by_length`, the permutation is cut into mega-batches of 50 batches and each is sorted
/// by length, longest first, so a batch holds examples of similar length (less padding), while the
/// order of mega-batches stays random — transformers' `LengthGroupedSampler` scheme.
pub fn epoch_order(
    lengths: &[usize],
    seed: u64,
    epoch: u64,
    shuffle: bool,
    group_by_length: Option<usize>,
) -> Vec<usize> {
    let mut order: Vec<usize> = (0..lengths.len()).collect();
    if !shuffle {
        return order;
    }
    let mut rng = StdRng::seed_from_u64(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ epoch);
    order.shuffle(&mut rng);
    if let Some(batch_size) = group_by_length {
        for mega in order.chunks_mut(batch_size.max(1) * 50) {
            mega.sort_by_key(|&i| std::cmp::Reverse(lengths[i]));
        }
    }
    order
}

/// This rank's share of an epoch's `order`, as PyTorch's `DistributedSampler` deals it: the order is
/// padded by repeating its start to a multiple of `world` (or truncated to one with `drop_last`),
/// then rank `r` takes every `world`-th example from position `r`. Every rank gets the same count,
/// and the first global batch of `world × b` examples is exactly the union of each rank's first `b`.
pub fn shard(order: &[usize], rank: usize, world: usize, drop_last: bool) -> Vec<usize> {
    if world <= 1 {
        return order.to_vec();
    }
    let n = order.len();
    let total = if drop_last {
        n / world * world
    } else {
        n.div_ceil(world) * world
    };
    (rank..total)
        .step_by(world)
        .map(|i| order[i % n.max(1)])
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_are_disjoint_equal_and_cover_the_epoch() {
        let order: Vec<usize> = (0..10).map(|i| (i * 7) % 10).collect();
        let (a, b, c) = (
            shard(&order, 0, 3, false),
            shard(&order, 1, 3, false),
            shard(&order, 2, 3, false),
        );
        assert_eq!((a.len(), b.len(), c.len()), (4, 4, 4));
        // 10 examples over 3 ranks: two are repeated (padding), none is lost.
        let mut all: Vec<usize> = a.iter().chain(&b).chain(&c).copied().collect();
        assert_eq!(&all[10..].len(), &2);
        all.sort();
        all.dedup();
        assert_eq!(all, (0..10).collect::<Vec<_>>());
        assert_eq!(shard(&order, 2, 3, true).len(), 3);
        // The union of the ranks' first batches of 2 is the single-process first batch of 6.
        let mut first: Vec<usize> = [&a[..2], &b[..2], &c[..2]].concat();
        first.sort();
        let mut want = order[..6].to_vec();
        want.sort();
        assert_eq!(first, want);
        assert_eq!(shard(&order, 0, 1, false), order);
    }

    #[test]
    fn collate_pads_to_longest_or_fixed_length() {
        let a = Encoded {
            input_ids: vec![101, 7, 102],
            token_type_ids: vec![0, 0, 0],
        };
        let b = Encoded {
            input_ids: vec![101, 102],
            token_type_ids: vec![0, 0],
        };
        let d = collate(&[&a, &b], Padding::Longest, 0);
        assert_eq!((d.batch, d.seq), (2, 3));
        assert_eq!(d.input_ids, vec![101, 7, 102, 101, 102, 0]);
        assert_eq!(d.attention_mask, vec![1, 1, 1, 1, 1, 0]);
        let f = collate(&[&a, &b], Padding::MaxLength(5), 0);
        assert_eq!(f.seq, 5);
        assert_eq!(f.attention_mask, vec![1, 1, 1, 0, 0, 1, 1, 0, 0, 0]);
        // transformers' pad_to_multiple_of: 3 tokens round up to 8, a multiple already stays, and
        // the truncation length caps the rounding (never past it, never below the longest).
        let multiple = |multiple, max, rows: &[&Encoded]| {
            collate(rows, Padding::MultipleOf { multiple, max }, 0).seq
        };
        assert_eq!(multiple(8, 128, &[&a, &b]), 8);
        assert_eq!(multiple(3, 128, &[&a, &b]), 3);
        assert_eq!(multiple(8, 6, &[&a, &b]), 6);
        assert_eq!(multiple(8, 2, &[&a, &b]), 3);
        assert_eq!(multiple(1, 128, &[&b]), 2);
        assert_eq!(multiple(usize::MAX, 128, &[&a, &b]), 128);
        let m = collate(
            &[&a, &b],
            Padding::MultipleOf {
                multiple: 4,
                max: 128,
            },
            0,
        );
        assert_eq!(m.attention_mask, vec![1, 1, 1, 0, 1, 1, 0, 0]);
        assert_eq!(m.input_ids, vec![101, 7, 102, 0, 101, 102, 0, 0]);
    }

    #[test]
    fn epoch_order_is_a_permutation_that_changes_per_epoch() {
        let lengths = vec![3; 100];
        let a = epoch_order(&lengths, 42, 0, true, None);
        let b = epoch_order(&lengths, 42, 1, true, None);
        let mut sorted = a.clone();
        sorted.sort();
        assert_eq!(sorted, (0..100).collect::<Vec<_>>());
        assert_ne!(a, b);
        assert_eq!(a, epoch_order(&lengths, 42, 0, true, None));
    }

    #[test]
    fn grouping_by_length_sorts_within_megabatches() {
        let lengths: Vec<usize> = (0..400).map(|i| (i * 7919) % 97).collect();
        let order = epoch_order(&lengths, 1, 0, true, Some(4));
        for mega in order.chunks(200) {
            assert!(mega.windows(2).all(|w| lengths[w[0]] >= lengths[w[1]]));
        }
    }
}
