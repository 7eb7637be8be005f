//! What one attention call is asked for: the [`Window`] of keys each query sees and the
//! [`AttentionSpec`] a backend's attention kernels take (heads, window, score scale, dropout).
//! The kernels themselves live with their backends (`cpu/attention.rs`, `gpu/attention.rs`) and
//! in the composed reference ([`super::composed_attention`]).

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

use super::Dropout;

/// One attention call's parameters beside its tensors: `heads` query heads side by side in the
/// hidden dimension, the keys each query sees (`window`), the scale of `q·kᵀ` (usually `1/√d`)
/// and the dropout on the probabilities. The backward takes the same spec as its forward (the
/// probabilities it is handed already hold the window and the padding mask).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionSpec {
    pub heads: usize,
    pub window: Window,
    pub scale: f64,
    pub dropout: Dropout,
}

impl AttentionSpec {
    /// `heads` heads of `head_dim` values over `window`, scaled by `1/√head_dim`, without dropout.
    pub fn new(heads: usize, head_dim: usize, window: Window) -> Self {
        Self {
            heads,
            window,
            scale: 1.0 / (head_dim as f64).sqrt(),
            dropout: Dropout::NONE,
        }
    }

    /// The same attention with `dropout` on its probabilities.
    pub fn with_dropout(self, dropout: Dropout) -> Self {
        Self { dropout, ..self }
    }
}

/// Which keys a query sees, beside the padding mask: those at most `before` positions earlier
/// and `after` later (a sliding window: Mistral, ModernBERT's local layers). [`Window::FULL`]
/// sees every key, [`Window::CAUSAL`] the query and the ones before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    pub before: usize,
    pub after: usize,
}

impl Window {
    pub const FULL: Self = Self {
        before: usize::MAX,
        after: usize::MAX,
    };
    pub const CAUSAL: Self = Self {
        before: usize::MAX,
        after: 0,
    };

    /// The keys query `i` of a `t`-token sequence sees.
    pub fn keys(&self, i: usize, t: usize) -> std::ops::Range<usize> {
        i.saturating_sub(self.before)..i.saturating_add(self.after).saturating_add(1).min(t)
    }

    /// Whether every query of a `t`-token sequence sees every key.
    pub fn covers(&self, t: usize) -> bool {
        let last = t.saturating_sub(1);
        self.before >= last && self.after >= last
    }

    /// The additive `[T, T]` mask of the window: 0 inside, a large finite negative outside (not
    /// -inf: it is scaled before the softmax, and a padding query whose keys are all hidden must
    /// stay finite). Made once per window, length, backend and device on a thread and then shared
    /// ([`BANDS`]): every layer of a step asks for the same one.
    pub fn band<B: Backend>(&self, t: usize, device: &B::Device) -> Tensor<B, 2> {
        let key = (std::any::TypeId::of::<B>(), *self, t);
        let cached = BANDS.with(|bands| {
            bands.borrow().iter().find_map(|(k, band)| {
                let band = band.downcast_ref::<Tensor<B, 2>>()?;
                (*k == key && band.device() == *device).then(|| band.clone())
            })
        });
        if let Some(band) = cached {
            return band;
        }
        let values: Vec<f32> = (0..t)
            .flat_map(|i| {
                let seen = self.keys(i, t);
                (0..t).map(move |j| if seen.contains(&j) { 0.0 } else { -1e30 })
            })
            .collect();
        let band = Tensor::<B, 2>::from_data(burn::tensor::TensorData::new(values, [t, t]), device);
        BANDS.with(|bands| {
            let mut bands = bands.borrow_mut();
            if bands.len() == BANDS_KEPT {
                bands.remove(0);
            }
            bands.push((key, Box::new(band.clone())));
        });
        band
    }
}

/// How many bands [`BANDS`] keeps: a few lengths (dynamic padding) of a model's one or two windows.
pub(crate) const BANDS_KEPT: usize = 8;

thread_local! {
    /// The bands [`Window::band`] made last on this thread, oldest first, keyed by backend, window
    /// and length (the tensor holds its device). A host profile of a SmolLM2 step on an H200 found
    /// a quarter of the step's host time building the causal band again for each of its 30 layers
    /// (and each uploaded 1 MiB). A shared tensor is never changed in place: Burn writes in place
    /// only into a tensor nothing else holds.
    static BANDS: std::cell::RefCell<Vec<BandEntry>> = const { std::cell::RefCell::new(Vec::new()) };
}

pub(crate) type BandEntry = ((std::any::TypeId, Window, usize), Box<dyn std::any::Any>);
