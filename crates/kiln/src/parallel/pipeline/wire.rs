//! What a pipeline stage hands its neighbour: a `[B, T, H]` activation (or its gradient) as one
//! flat message, its three dimensions first, so the receiver needs no shape of its own (packed and
//! padded batches alike) and a malformed message is an error naming the stage that sent it.
//! Training, evaluation and generation under a pipeline all hand over this way.

use burn::tensor::{Tensor, TensorData};

use crate::parallel::Collectives;
use crate::{KilnError, Result};

/// Sends `t` with its dimensions first.
pub fn hand_over<B: burn::tensor::backend::Backend>(
    group: &dyn Collectives<B>,
    t: Tensor<B, 3>,
    to: usize,
) -> Result<()> {
    let dims = t.dims();
    let device = t.device();
    let n = dims.iter().product::<usize>();
    let head = Tensor::<B, 1>::from_data(
        TensorData::new(dims.iter().map(|&d| d as f32).collect::<Vec<_>>(), [3]),
        &device,
    );
    group.send(Tensor::cat(vec![head, t.reshape([n])], 0), to)?;
    crate::io::files::crash_point("pipeline:hand-over");
    Ok(())
}

/// What [`hand_over`] sent from `from`, in its shape.
pub fn receive<B: burn::tensor::backend::Backend>(
    group: &dyn Collectives<B>,
    from: usize,
) -> Result<Tensor<B, 3>> {
    let flat = group.recv(from)?;
    let n = flat.dims()[0];
    let bad = |what: String| {
        KilnError::Distributed(format!(
            "stage {from} handed over a malformed tensor: {what}"
        ))
    };
    if n < 3 {
        return Err(bad(format!("{n} values, fewer than its 3 dimensions")));
    }
    let dims: Vec<usize> = flat
        .clone()
        .narrow(0, 0, 3)
        .into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .expect("f32 data")
        .into_iter()
        .map(|d| d as usize)
        .collect();
    let numel = dims.iter().try_fold(1usize, |p, &d| p.checked_mul(d));
    if numel != Some(n - 3) {
        return Err(bad(format!("{} values for the shape {dims:?}", n - 3)));
    }
    Ok(flat
        .narrow(0, 3, n - 3)
        .reshape([dims[0], dims[1], dims[2]]))
}
