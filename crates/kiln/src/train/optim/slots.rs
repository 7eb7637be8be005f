//! What every rule's step works with: one parameter's state slots under torch's names, the step's
//! learning rate and weight decay, and flat tensors handed to and from the fused kernels.

use std::collections::BTreeMap;

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, TensorPrimitive};

/// One parameter's state slots, stored under `<path>.<slot>` (torch's state names), as a rule's
/// step reads and writes them.
pub(super) struct Slots<'a, B: Backend> {
    pub(super) state: &'a mut BTreeMap<String, Tensor<B, 1>>,
    pub(super) path: &'a str,
}

impl<B: Backend> Slots<'_, B> {
    /// Slot `slot`, or zeros like `like` (of `len` values) on the first step.
    pub(super) fn take(&mut self, slot: &str, len: usize, like: &Tensor<B, 1>) -> Tensor<B, 1> {
        let path = self.path;
        match self.state.remove(&format!("{path}.{slot}")) {
            Some(t) => {
                assert_eq!(
                    t.dims()[0],
                    len,
                    "{path}.{slot} does not match its parameter"
                );
                t
            }
            None => Tensor::zeros([len], &like.device()),
        }
    }

    /// Slot `slot` if the parameter has it (a buffer some steps never make).
    pub(super) fn remove(&mut self, slot: &str) -> Option<Tensor<B, 1>> {
        self.state.remove(&format!("{}.{slot}", self.path))
    }

    pub(super) fn put(&mut self, slot: &str, t: Tensor<B, 1>) {
        self.state.insert(format!("{}.{slot}", self.path), t);
    }
}

/// The learning rate of a step and the weight decay that applies to the parameter (0 when it does
/// not decay).
#[derive(Clone, Copy)]
pub(super) struct At {
    pub lr: f64,
    pub weight_decay: f64,
}

/// The backend's float tensor inside `t`, for the fused kernels.
pub(super) fn prim<B: Backend>(t: Tensor<B, 1>) -> FloatTensor<B> {
    t.into_primitive().tensor()
}

pub(super) fn tensor<B: Backend>(p: FloatTensor<B>) -> Tensor<B, 1> {
    Tensor::from_primitive(TensorPrimitive::Float(p))
}
