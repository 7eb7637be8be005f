//! Who is alive and how far each worker got, so a failure names the worker that caused it.
//!
//! Every worker sends a small UDP datagram to rank 0 (on `MASTER_PORT`, which the rendezvous uses
//! for TCP only) four times a second: its rank, its WORLD_SIZE and how many collectives it has
//! entered. Rank 0 keeps the board of what it last heard from whom, and answers each datagram with
//! it. When a collective times out or a connection breaks, any worker can then say which peer did
//! not arrive: silent (stopped, hung or dead) or alive but behind. A worker whose WORLD_SIZE differs
//! from rank 0's learns it from the first answer, whatever the load, before any timeout.
//!
//! The board is best effort: if the datagrams cannot pass (a firewall), errors simply say less.

use std::net::UdpSocket;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::DistEnv;

/// How often a worker reports.
const INTERVAL: Duration = Duration::from_millis(250);
/// Silence longer than this means the worker is not running (stopped, hung outside a collective's
/// wait, or dead): a live worker reports four times a second even while it computes.
const STALE: Duration = Duration::from_secs(2);

/// What this worker knows of one rank.
#[derive(Debug, Clone, Copy, Default)]
struct Seen {
    /// Collectives the rank had entered when last heard.
    seq: u64,
    /// When it was last heard (`None`: never).
    at: Option<Instant>,
}

/// A worker's view of the job's liveness.
pub struct Heartbeat {
    env: DistEnv,
    /// Collectives this worker has entered.
    seq: AtomicU64,
    board: Mutex<Vec<Seen>>,
    /// When rank 0 last answered (other ranks).
    answered: Mutex<Option<Instant>>,
    /// A WORLD_SIZE disagreement, once seen.
    mismatch: Mutex<Option<String>>,
    started: Instant,
}

impl Heartbeat {
    /// Starts reporting (and, on rank 0, keeping the board) on background threads.
    pub fn start(env: &DistEnv) -> Arc<Self> {
        let hb = Arc::new(Self {
            env: env.clone(),
            seq: AtomicU64::new(0),
            board: Mutex::new(vec![Seen::default(); env.world_size]),
            answered: Mutex::new(None),
            mismatch: Mutex::new(None),
            started: Instant::now(),
        });
        let bound = if env.rank == 0 {
            UdpSocket::bind((env.node_addr.as_str(), env.master_port))
        } else {
            UdpSocket::bind((env.node_addr.as_str(), 0))
        };
        let socket = match bound.and_then(|s| s.set_read_timeout(Some(INTERVAL)).map(|()| s)) {
            Ok(s) => s,
            Err(e) => {
                tracing::debug!("heartbeat disabled: {e}");
                return hb;
            }
        };
        let me = hb.clone();
        let spawned = std::thread::Builder::new()
            .name("kiln-heartbeat".into())
            .spawn(move || {
                if me.env.rank == 0 {
                    me.serve(&socket)
                } else {
                    me.report(&socket)
                }
            });
        if let Err(e) = spawned {
            tracing::debug!("heartbeat disabled: {e}");
        }
        hb
    }

    /// Marks the start of one more collective; returns its number (1-based).
    pub fn enter(&self) -> u64 {
        self.seq.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// A WORLD_SIZE disagreement with rank 0 (or, on rank 0, with a worker), once seen.
    pub fn mismatch(&self) -> Option<String> {
        lock(&self.mismatch).clone()
    }

    fn hello(&self) -> String {
        format!(
            "kiln-hb {} {} {}",
            self.env.rank,
            self.env.world_size,
            self.seq.load(Ordering::Relaxed)
        )
    }

    /// Rank 0: answer every report with the board.
    fn serve(&self, socket: &UdpSocket) {
        let mut buf = [0u8; 256];
        loop {
            self.record(0, self.seq.load(Ordering::Relaxed));
            let Ok((n, from)) = socket.recv_from(&mut buf) else {
                continue;
            };
            let text = String::from_utf8_lossy(&buf[..n]);
            let mut parts = text.split_whitespace();
            if parts.next() != Some("kiln-hb") {
                continue;
            }
            let nums: Vec<u64> = parts.filter_map(|p| p.parse().ok()).collect();
            let [rank, world, seq] = nums[..] else {
                continue;
            };
            let reply = if world as usize != self.env.world_size {
                self.set_mismatch(format!(
                    "rank {rank} joined with a different WORLD_SIZE ({world}) than this one's {} \
                     (every worker needs the same --nnodes × --nproc-per-node)",
                    self.env.world_size
                ));
                format!("kiln-mismatch {}", self.env.world_size)
            } else {
                self.record(rank as usize, seq);
                self.board_text()
            };
            let _ = socket.send_to(reply.as_bytes(), from);
        }
    }

    /// Other ranks: report, and keep rank 0's latest board.
    fn report(&self, socket: &UdpSocket) {
        let master = (self.env.master_addr.as_str(), self.env.master_port);
        let mut buf = [0u8; 65536];
        loop {
            let sent_at = Instant::now();
            let _ = socket.send_to(self.hello().as_bytes(), master);
            if let Ok(n) = socket.recv(&mut buf) {
                self.read_answer(&String::from_utf8_lossy(&buf[..n]));
            }
            if let Some(rest) = INTERVAL.checked_sub(sent_at.elapsed()) {
                std::thread::sleep(rest);
            }
        }
    }

    fn read_answer(&self, text: &str) {
        let mut parts = text.split_whitespace();
        match parts.next() {
            Some("kiln-mismatch") => {
                let theirs = parts.next().unwrap_or("?");
                self.set_mismatch(format!(
                    "rank 0 at {}:{} has a different WORLD_SIZE ({theirs}) than this one's {} \
                     (every worker needs the same --nnodes × --nproc-per-node)",
                    self.env.master_addr, self.env.master_port, self.env.world_size
                ));
            }
            Some("kiln-board") => {
                *lock(&self.answered) = Some(Instant::now());
                let now = Instant::now();
                let mut board = lock(&self.board);
                for (slot, entry) in board.iter_mut().zip(parts) {
                    let Some((seq, age)) = entry.split_once(':') else {
                        continue;
                    };
                    let (Ok(seq), Ok(age)) = (seq.parse::<u64>(), age.parse::<u64>()) else {
                        continue;
                    };
                    *slot = Seen {
                        seq,
                        at: (age != u64::MAX)
                            .then(|| now.checked_sub(Duration::from_millis(age)))
                            .flatten(),
                    };
                }
            }
            _ => {}
        }
    }

    fn set_mismatch(&self, msg: String) {
        lock(&self.mismatch).get_or_insert(msg);
    }

    fn record(&self, rank: usize, seq: u64) {
        if let Some(slot) = lock(&self.board).get_mut(rank) {
            *slot = Seen {
                seq,
                at: Some(Instant::now()),
            };
        }
    }

    /// `kiln-board seq:age_ms ...` (age `u64::MAX` for never).
    fn board_text(&self) -> String {
        let board = lock(&self.board);
        let mut s = String::from("kiln-board");
        for seen in board.iter() {
            let age = seen.at.map_or(u64::MAX, |t| t.elapsed().as_millis() as u64);
            s.push_str(&format!(" {}:{age}", seen.seq));
        }
        s
    }

    /// Which peers this worker, waiting in its collective, is waiting for, and why: one clause.
    pub fn describe_peers(&self) -> String {
        let me = self.env.rank;
        let mine = self.seq.load(Ordering::Relaxed);
        if me != 0 {
            let answered = *lock(&self.answered);
            match answered {
                None => {
                    return format!(
                        "rank 0 at {}:{} never answered (is it started, at this address?)",
                        self.env.master_addr, self.env.master_port
                    )
                }
                Some(t) if t.elapsed() > STALE => {
                    return format!(
                        "rank 0 has not answered for {:.1} s (stopped, hung or dead)",
                        t.elapsed().as_secs_f64()
                    )
                }
                _ => {}
            }
        }
        let board = lock(&self.board);
        let mut why = Vec::new();
        for (rank, seen) in board.iter().enumerate().filter(|(r, _)| *r != me) {
            match seen.at {
                None => why.push(format!(
                    "rank {rank} was never heard from in {:.0} s",
                    self.started.elapsed().as_secs_f64()
                )),
                Some(t) if t.elapsed() > STALE => why.push(format!(
                    "rank {rank} has been silent for {:.1} s (stopped, hung or dead; last seen \
                     at collective #{})",
                    t.elapsed().as_secs_f64(),
                    seen.seq
                )),
                Some(_) if seen.seq < mine => why.push(format!(
                    "rank {rank} is alive but has not reached this collective (it is at #{}, this \
                     rank at #{mine}: still computing, or stuck outside a collective)",
                    seen.seq
                )),
                Some(_) => {}
            }
        }
        if why.is_empty() {
            "every peer was heard from recently and had reached this collective".into()
        } else {
            why.join("; ")
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(rank: usize, world: usize, port: u16) -> DistEnv {
        DistEnv {
            rank,
            local_rank: rank,
            world_size: world,
            local_world_size: world,
            master_addr: "127.0.0.1".into(),
            master_port: port,
            node_addr: "127.0.0.1".into(),
        }
    }

    /// A UDP port nothing else uses right now (the OS picks it).
    fn free_udp_port() -> u16 {
        UdpSocket::bind(("127.0.0.1", 0))
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    fn wait_for(mut f: impl FnMut() -> bool) {
        let t0 = Instant::now();
        while !f() {
            assert!(t0.elapsed() < Duration::from_secs(20), "timed out");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    #[test]
    fn names_the_peer_that_is_behind_and_the_one_that_is_silent() {
        let port = free_udp_port();
        let r0 = Heartbeat::start(&env(0, 3, port));
        let r1 = Heartbeat::start(&env(1, 3, port));
        // Rank 2 never starts. Rank 0 enters a collective rank 1 has not reached.
        r0.enter();
        wait_for(|| r1.describe_peers().contains("rank 2 was never heard from"));
        let d = r0.describe_peers();
        assert!(d.contains("rank 1 is alive but has not reached"), "{d}");
        assert!(d.contains("rank 2 was never heard from"), "{d}");
        r1.enter();
        wait_for(|| !r0.describe_peers().contains("rank 1"));
    }

    #[test]
    fn a_world_size_mismatch_is_seen_by_both_sides() {
        let port = free_udp_port();
        let r0 = Heartbeat::start(&env(0, 2, port));
        let r1 = Heartbeat::start(&env(1, 3, port));
        wait_for(|| r1.mismatch().is_some() && r0.mismatch().is_some());
        let m = r1.mismatch().unwrap();
        assert!(
            m.contains("different WORLD_SIZE (2) than this one's 3"),
            "{m}"
        );
        let m = r0.mismatch().unwrap();
        assert!(
            m.contains("rank 1 joined with a different WORLD_SIZE (3)"),
            "{m}"
        );
    }
}
