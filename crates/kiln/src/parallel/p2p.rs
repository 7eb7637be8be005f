//! Point-to-point links between ranks: a pipeline's activations going forward and their gradients
//! coming back. Burn's collective engine only all-reduces (a hand-over built from an all-gather
//! moves `size ×` the data), and a 1F1B schedule needs each stage to hand a tensor to one neighbour
//! while the others compute. These links do that on any engine:
//! - every rank listens on a port the OS picks, on its node address (`KILN_NODE_ADDR`);
//! - the ranks learn each other's `host:port` through one all-gather of the engine they run on;
//! - a send queues the values and returns: a writer thread per peer streams them over one TCP
//!   connection, so two neighbours sending to each other at once never wait on each other (a
//!   blocking send there deadlocks as soon as a tensor outgrows the socket buffers);
//! - a reader thread per peer fills that peer's inbox; a receive takes the oldest message of one
//!   peer, so order holds per pair of ranks, as NCCL's and MPI's do.
//!
//! A receive that waits longer than the job's timeout is an error naming the peer; the process
//! group runs it under its watchdog, which also names a peer that died.

use std::collections::hash_map::Entry;
use std::collections::{HashMap, VecDeque};
use std::io::{BufReader, BufWriter, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};

use super::collectives::{host, Collectives};
use crate::{KilnError, Result};

/// What arrived from each peer, and why a peer's connection ended.
#[derive(Default)]
struct Mail {
    queues: HashMap<usize, VecDeque<Vec<f32>>>,
    closed: HashMap<usize, String>,
}

#[derive(Default)]
struct Inbox {
    mail: Mutex<Mail>,
    arrived: Condvar,
}

impl Inbox {
    fn push(&self, from: usize, values: Vec<f32>) {
        let mut q = self.mail.lock().unwrap_or_else(|e| e.into_inner());
        q.queues.entry(from).or_default().push_back(values);
        self.arrived.notify_all();
    }

    fn close(&self, from: usize, why: String) {
        let mut q = self.mail.lock().unwrap_or_else(|e| e.into_inner());
        q.closed.insert(from, why);
        self.arrived.notify_all();
    }

    /// The oldest message of `from`, waiting up to `timeout`.
    fn pop(&self, me: usize, from: usize, timeout: Duration) -> Result<Vec<f32>> {
        let deadline = Instant::now() + timeout;
        let mut q = self.mail.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(v) = q.queues.get_mut(&from).and_then(VecDeque::pop_front) {
                return Ok(v);
            }
            if let Some(why) = q.closed.get(&from) {
                return Err(KilnError::Distributed(format!(
                    "rank {me}: the link from rank {from} ended before its tensor arrived ({why})"
                )));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(KilnError::Distributed(format!(
                    "rank {me}: rank {from} sent nothing within {}s (it died, hung, or runs another schedule)",
                    timeout.as_secs()
                )));
            }
            q = self
                .arrived
                .wait_timeout(q, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

/// One rank's links to every other rank of its job, opened on first use per peer.
pub struct Links {
    rank: usize,
    /// Every rank's `host:port`, in rank order.
    addresses: Vec<String>,
    outgoing: Mutex<HashMap<usize, Sender<Vec<f32>>>>,
    /// The writer threads, waited for when the links go ([`Drop`]).
    writers: Mutex<Vec<std::thread::JoinHandle<()>>>,
    /// The first error of a writer thread, reported by the next send.
    send_error: Arc<Mutex<Option<String>>>,
    inbox: Arc<Inbox>,
    timeout: Duration,
}

impl Links {
    /// Listens on `node_addr`, learns every rank's address through `world` (all ranks call this at
    /// once) and accepts the links peers open to this rank.
    pub fn open<B: Backend>(
        world: &dyn Collectives<B>,
        node_addr: &str,
        timeout: Duration,
    ) -> Result<Self> {
        let rank = world.rank();
        let listener = TcpListener::bind((node_addr, 0)).map_err(|e| {
            KilnError::Distributed(format!(
                "rank {rank}: cannot listen for point-to-point links on {node_addr}: {e} \
                 (set KILN_NODE_ADDR to an address of this machine)"
            ))
        })?;
        let port = listener
            .local_addr()
            .map_err(net(rank, "the link listener has no address"))?
            .port();
        let addresses = exchange_addresses(world, &format!("{node_addr}:{port}"))?;
        let inbox = Arc::new(Inbox::default());
        let accepting = inbox.clone();
        std::thread::Builder::new()
            .name("kiln-p2p-accept".into())
            .spawn(move || {
                for stream in listener.incoming().flatten() {
                    let inbox = accepting.clone();
                    let _ = std::thread::Builder::new()
                        .name("kiln-p2p-read".into())
                        .spawn(move || read_messages(stream, &inbox));
                }
            })
            .map_err(net(rank, "cannot start the link listener"))?;
        Ok(Self {
            rank,
            addresses,
            outgoing: Mutex::new(HashMap::new()),
            writers: Mutex::new(Vec::new()),
            send_error: Arc::new(Mutex::new(None)),
            inbox,
            timeout,
        })
    }

    /// Queues `values` for rank `to` and returns; they arrive after everything sent to it before.
    pub fn send(&self, to: usize, values: Vec<f32>) -> Result<()> {
        if let Some(e) = self
            .send_error
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
        {
            return Err(KilnError::Distributed(e));
        }
        let mut out = self.outgoing.lock().unwrap_or_else(|e| e.into_inner());
        let writer = match out.entry(to) {
            Entry::Occupied(w) => w.into_mut(),
            Entry::Vacant(slot) => slot.insert(self.connect(to)?),
        };
        writer.send(values).map_err(|_| {
            KilnError::Distributed(format!(
                "rank {}: the link to rank {to} is closed",
                self.rank
            ))
        })
    }

    /// The oldest tensor rank `from` sent to this rank, waiting up to the job's timeout.
    pub fn recv(&self, from: usize) -> Result<Vec<f32>> {
        self.inbox.pop(self.rank, from, self.timeout)
    }

    /// A writer thread streaming to rank `to`, after a hello that names this rank.
    fn connect(&self, to: usize) -> Result<Sender<Vec<f32>>> {
        let addr = self.addresses.get(to).ok_or_else(|| {
            KilnError::Distributed(format!(
                "rank {}: there is no rank {to} in a job of {}",
                self.rank,
                self.addresses.len()
            ))
        })?;
        let stream = TcpStream::connect(addr).map_err(|e| {
            KilnError::Distributed(format!(
                "rank {}: cannot reach rank {to} at {addr}: {e}",
                self.rank
            ))
        })?;
        let hello = |stream: TcpStream| -> std::io::Result<BufWriter<TcpStream>> {
            stream.set_nodelay(true)?;
            let mut w = BufWriter::with_capacity(1 << 20, stream);
            w.write_all(&(self.rank as u64).to_le_bytes())?;
            w.flush()?;
            Ok(w)
        };
        let mut w = hello(stream).map_err(net(self.rank, &format!("cannot greet rank {to}")))?;
        let (tx, rx) = channel::<Vec<f32>>();
        let (me, error) = (self.rank, self.send_error.clone());
        let writer = std::thread::Builder::new()
            .name("kiln-p2p-write".into())
            .spawn(move || {
                for values in rx {
                    if let Err(e) = write_message(&mut w, &values) {
                        *error.lock().unwrap_or_else(|e| e.into_inner()) =
                            Some(format!("rank {me}: lost the link to rank {to}: {e}"));
                        return;
                    }
                }
            })
            .map_err(net(self.rank, "cannot start a link writer"))?;
        self.writers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(writer);
        Ok(tx)
    }
}

impl Drop for Links {
    /// A send only queues, so what is still queued is written before the links go: a rank that
    /// hands over its last tensor (the last stage's final token under `kiln generate`) and exits
    /// would otherwise take it along, and its peer would read a link that ended before the tensor
    /// arrived. Closing the queues ends each writer once it has written them; the wait is bounded by
    /// the job's timeout (a peer that stopped reading must not hang this rank's exit).
    fn drop(&mut self) {
        self.outgoing
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
        let deadline = Instant::now() + self.timeout;
        let writers = std::mem::take(self.writers.get_mut().unwrap_or_else(|e| e.into_inner()));
        for w in writers {
            while !w.is_finished() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(1));
            }
            if w.is_finished() {
                let _ = w.join();
            }
        }
    }
}

/// The links of `cell`, or the sentence saying they were never opened.
pub(crate) fn opened(cell: &std::sync::OnceLock<Links>, rank: usize) -> Result<&Links> {
    cell.get().ok_or_else(|| {
        KilnError::Distributed(format!(
            "rank {rank}: point-to-point transfer before the links were opened (open_links)"
        ))
    })
}

/// A networking error of rank `rank` as one sentence.
fn net(rank: usize, what: &str) -> impl FnOnce(std::io::Error) -> KilnError + '_ {
    move |e| KilnError::Distributed(format!("rank {rank}: {what}: {e}"))
}

/// One message: its length in values, then the values as little-endian f32.
fn write_message(w: &mut impl Write, values: &[f32]) -> std::io::Result<()> {
    w.write_all(&(values.len() as u64).to_le_bytes())?;
    for chunk in values.chunks(1 << 16) {
        let bytes: Vec<u8> = chunk.iter().flat_map(|v| v.to_le_bytes()).collect();
        w.write_all(&bytes)?;
    }
    w.flush()
}

/// The most values one message may carry (16 GiB of f32): far above any hand-over.
const MAX_MESSAGE_VALUES: u64 = 1 << 32;

/// Reads a peer's hello, then its messages into the inbox until the connection ends.
fn read_messages(stream: TcpStream, inbox: &Inbox) {
    let mut r = BufReader::with_capacity(1 << 20, stream);
    let mut word = [0u8; 8];
    if r.read_exact(&mut word).is_err() {
        return;
    }
    let from = u64::from_le_bytes(word) as usize;
    loop {
        if let Err(e) = r.read_exact(&mut word) {
            inbox.close(from, format!("{e}"));
            return;
        }
        // A length no tensor has (a corrupt stream, or something else on the port) ends the link
        // with a reason instead of an allocation sized by it.
        let n = u64::from_le_bytes(word);
        if n > MAX_MESSAGE_VALUES {
            inbox.close(
                from,
                format!("a message of {n} values exceeds the limit of {MAX_MESSAGE_VALUES}"),
            );
            return;
        }
        let mut bytes = vec![0u8; n as usize * 4];
        if let Err(e) = r.read_exact(&mut bytes) {
            inbox.close(from, format!("{e}"));
            return;
        }
        let values = bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        inbox.push(from, values);
    }
}

/// Every rank's `mine`, in rank order, through two all-gathers of `world` (the lengths, then the
/// bytes, each byte one exactly representable f32).
fn exchange_addresses<B: Backend>(world: &dyn Collectives<B>, mine: &str) -> Result<Vec<String>> {
    let device = world.device().clone();
    let one = |v: Vec<f32>| {
        let n = v.len();
        Tensor::<B, 1>::from_data(TensorData::new(v, [n]), &device)
    };
    let lengths: Vec<usize> = host(world.all_gather(one(vec![mine.len() as f32]))?)
        .into_iter()
        .map(|n| n as usize)
        .collect();
    let bytes = host(world.all_gather_v(one(mine.bytes().map(f32::from).collect()), &lengths)?);
    let mut start = 0;
    Ok(lengths
        .iter()
        .map(|&n| {
            let s = bytes[start..start + n].iter().map(|&b| b as u8).collect();
            start += n;
            String::from_utf8(s).unwrap_or_default()
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{Cpu, CpuDevice};
    use crate::parallel::threads::ThreadComm;

    /// Three ranks' links over loopback TCP, opened through an in-process group.
    fn run_links<T: Send>(size: usize, f: impl Fn(&Links) -> T + Sync) -> Vec<T> {
        let comms = ThreadComm::<Cpu>::group(size, &CpuDevice::default());
        std::thread::scope(|s| {
            let f = &f;
            let handles: Vec<_> = comms
                .into_iter()
                .map(|c| {
                    s.spawn(move || {
                        let links = Links::open(&c, "127.0.0.1", Duration::from_secs(20))
                            .expect("links open");
                        f(&links)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    /// Neighbours send each other 24 MB at the same time (far beyond any socket buffer: a
    /// blocking send would deadlock), several messages each, and each arrives whole and in order.
    #[test]
    fn neighbours_exchange_large_tensors_both_ways_in_order() {
        let n = 6 << 20;
        let got = run_links(3, |l| {
            let me = l.rank;
            let (next, prev) = ((me + 1) % 3, (me + 2) % 3);
            for k in 0..3 {
                let v: Vec<f32> = (0..n).map(|i| (me * 10 + k) as f32 + i as f32).collect();
                l.send(next, v).unwrap();
                l.send(prev, vec![-(me as f32), k as f32]).unwrap();
            }
            let mut seen = Vec::new();
            for k in 0..3 {
                let big = l.recv(prev).unwrap();
                assert_eq!(big.len(), n);
                assert_eq!(big[0], (prev * 10 + k) as f32);
                assert_eq!(big[n - 1], (prev * 10 + k) as f32 + (n - 1) as f32);
                seen.push(l.recv(next).unwrap());
            }
            seen
        });
        for (me, seen) in got.iter().enumerate() {
            let next = (me + 1) % 3;
            let want: Vec<Vec<f32>> = (0..3).map(|k| vec![-(next as f32), k as f32]).collect();
            assert_eq!(seen, &want, "rank {me}");
        }
    }

    /// A receive from a peer that never sends ends with a sentence naming both ranks.
    #[test]
    fn a_silent_peer_is_named_after_the_timeout() {
        let comms = ThreadComm::<Cpu>::group(2, &CpuDevice::default());
        let errors: Vec<String> = std::thread::scope(|s| {
            let handles: Vec<_> = comms
                .into_iter()
                .map(|c| {
                    s.spawn(move || {
                        let l = Links::open(&c, "127.0.0.1", Duration::from_millis(300)).unwrap();
                        l.recv(1 - l.rank).unwrap_err().to_string()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(
            errors[0].contains("rank 0: rank 1 sent nothing"),
            "{}",
            errors[0]
        );
        assert!(
            errors[1].contains("rank 1: rank 0 sent nothing"),
            "{}",
            errors[1]
        );
    }
}
