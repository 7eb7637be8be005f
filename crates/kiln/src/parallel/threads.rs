//! An in-process engine: the ranks are threads of one process that meet at a barrier and read each
//! other's buffers. No networking, no watchdog; what it is for is checking the arithmetic of a
//! parallel strategy (tensor-parallel layers, vocab-parallel cross-entropy) against a
//! single-process run in a unit test, in milliseconds.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Barrier, Condvar, Mutex};

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

use super::collectives::{host, Collectives, ReduceOp};
use crate::Result;

/// Point-to-point messages by (from, to), oldest first.
type Mailbox = HashMap<(usize, usize), VecDeque<Vec<f32>>>;

struct Shared {
    barrier: Barrier,
    slots: Mutex<Vec<Vec<f32>>>,
    /// Point-to-point mail: what each (from, to) pair sent and was not yet received.
    mail: Mutex<Mailbox>,
    posted: Condvar,
}

/// One thread's handle on a group of `size` threads.
pub struct ThreadComm<B: Backend> {
    shared: Arc<Shared>,
    rank: usize,
    size: usize,
    device: B::Device,
}

impl<B: Backend> ThreadComm<B> {
    /// The `size` handles of one group, to hand one to each thread.
    pub fn group(size: usize, device: &B::Device) -> Vec<Self> {
        let shared = Arc::new(Shared {
            barrier: Barrier::new(size),
            slots: Mutex::new(vec![Vec::new(); size]),
            mail: Mutex::new(HashMap::new()),
            posted: Condvar::new(),
        });
        (0..size)
            .map(|rank| Self {
                shared: shared.clone(),
                rank,
                size,
                device: device.clone(),
            })
            .collect()
    }

    /// Every rank's `values`, in rank order.
    fn exchange(&self, values: Vec<f32>) -> Vec<Vec<f32>> {
        self.shared.slots.lock().expect("slots")[self.rank] = values;
        self.shared.barrier.wait();
        let all = self.shared.slots.lock().expect("slots").clone();
        // Nobody writes the next round before everyone has read this one.
        self.shared.barrier.wait();
        all
    }

    fn tensor(&self, v: Vec<f32>) -> Tensor<B, 1> {
        super::collectives::owned_tensor(v, &self.device)
    }
}

impl<B: Backend> Collectives<B> for ThreadComm<B> {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn device(&self) -> &B::Device {
        &self.device
    }

    fn all_reduce(&self, t: Tensor<B, 1>, op: ReduceOp) -> Result<Tensor<B, 1>> {
        let all = self.exchange(host(t));
        // Summed in rank order on every rank, so all ranks get bit-identical results.
        let mut out = all[0].clone();
        for other in &all[1..] {
            for (o, v) in out.iter_mut().zip(other) {
                *o = match op {
                    ReduceOp::Sum | ReduceOp::Mean => *o + v,
                    ReduceOp::Max => o.max(*v),
                };
            }
        }
        if op == ReduceOp::Mean {
            out.iter_mut().for_each(|o| *o /= self.size as f32);
        }
        Ok(self.tensor(out))
    }

    fn all_gather_v(&self, t: Tensor<B, 1>, counts: &[usize]) -> Result<Tensor<B, 1>> {
        let all = self.exchange(host(t));
        debug_assert!(all.iter().zip(counts).all(|(v, &k)| v.len() == k));
        Ok(self.tensor(all.concat()))
    }

    fn broadcast(&self, t: Tensor<B, 1>, root: usize) -> Result<Tensor<B, 1>> {
        let mut all = self.exchange(host(t));
        Ok(self.tensor(std::mem::take(&mut all[root])))
    }

    fn open_links(&self) -> Result<()> {
        Ok(())
    }

    fn send(&self, t: Tensor<B, 1>, to: usize) -> Result<()> {
        let mut mail = self.shared.mail.lock().expect("mail");
        mail.entry((self.rank, to)).or_default().push_back(host(t));
        self.shared.posted.notify_all();
        Ok(())
    }

    fn recv(&self, from: usize) -> Result<Tensor<B, 1>> {
        let mut mail = self.shared.mail.lock().expect("mail");
        loop {
            if let Some(v) = mail
                .get_mut(&(from, self.rank))
                .and_then(VecDeque::pop_front)
            {
                return Ok(self.tensor(v));
            }
            mail = self.shared.posted.wait(mail).expect("mail");
        }
    }
}
