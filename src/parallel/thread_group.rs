//! The CPU ranks' sum: threads of one process meet in shared memory.

use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};

use super::{aborted, Collective, Shard};
use crate::cpu::backend::CpuBackend;
use crate::error::{Error, Result};

/// One rank of a group of CPU ranks in threads of this process ([`ThreadGroup::new`] makes them all).
pub struct ThreadGroup {
    shard: Shard,
    meeting: Arc<Meeting>,
}

struct Meeting {
    state: Mutex<Round>,
    changed: Condvar,
}

/// One all-reduce: the ranks deposit their parts, then each sums them all; the last to read clears the
/// round for the next.
#[derive(Default)]
struct Round {
    parts: Vec<Option<Vec<f32>>>,
    deposited: usize,
    read: usize,
    aborted: bool,
}

impl ThreadGroup {
    /// The `world` ranks of a new group, rank 0 first.
    pub fn new(world: usize) -> Result<Vec<ThreadGroup>> {
        if world == 0 {
            return Err(Error::param("world", 0, "a group needs at least one rank"));
        }
        let meeting = Arc::new(Meeting {
            state: Mutex::new(Round { parts: vec![None; world], ..Round::default() }),
            changed: Condvar::new(),
        });
        Ok((0..world).map(|rank| ThreadGroup { shard: Shard { rank, world }, meeting: meeting.clone() }).collect())
    }

    fn lock(&self) -> MutexGuard<'_, Round> {
        self.meeting.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// One round: deposits this rank's `part`, waits for every rank's, and hands them all, in rank
    /// order, to `read`; the last rank to read clears the round for the next. Parts of different lengths
    /// abort the group.
    fn meet(&self, part: Vec<f32>, read: impl FnOnce(&[&Vec<f32>])) -> Result<()> {
        let (rank, world, n) = (self.shard.rank, self.shard.world, part.len());
        // A round still being read belongs to the ranks before: wait until it is cleared.
        let mut round = self.wait_until(self.lock(), |r| r.parts[rank].is_none() && r.read == 0)?;
        round.parts[rank] = Some(part);
        round.deposited += 1;
        self.meeting.changed.notify_all();
        let mut round = self.wait_until(round, |r| r.deposited == world)?;
        let parts: Vec<&Vec<f32>> = round.parts.iter().map(|p| p.as_ref().expect("every rank deposited")).collect();
        if let Some(p) = parts.iter().position(|p| p.len() != n) {
            let len = parts[p].len();
            round.aborted = true;
            self.meeting.changed.notify_all();
            return Err(Error::param("n", n, format!("rank {p} takes part with {len} elements in the same round")));
        }
        read(&parts);
        round.read += 1;
        if round.read == world {
            round.parts.iter_mut().for_each(|p| *p = None);
            round.deposited = 0;
            round.read = 0;
            self.meeting.changed.notify_all();
        }
        Ok(())
    }

    /// Waits on the meeting until `ready` holds; an error once the group is aborted.
    fn wait_until<'a>(
        &'a self,
        mut round: MutexGuard<'a, Round>,
        ready: impl Fn(&Round) -> bool,
    ) -> Result<MutexGuard<'a, Round>> {
        while !round.aborted && !ready(&round) {
            round = self.meeting.changed.wait(round).unwrap_or_else(PoisonError::into_inner);
        }
        if round.aborted {
            return Err(aborted());
        }
        Ok(round)
    }
}

impl Collective<CpuBackend> for ThreadGroup {
    fn shard(&self) -> Shard {
        self.shard
    }

    fn all_reduce(&self, _backend: &CpuBackend, x: &mut Vec<f32>, n: usize) -> Result<()> {
        let part = x.get(..n).ok_or_else(|| Error::shape("x", format!("at least {n} elements"), n, x.len()))?;
        let part = part.to_vec();
        self.meet(part, |parts| {
            let sum = &mut x[..n];
            sum.copy_from_slice(parts[0]);
            for p in &parts[1..] {
                sum.iter_mut().zip(p.iter()).for_each(|(s, v)| *s += v);
            }
        })
    }

    fn all_gather(&self, _backend: &CpuBackend, x: &Vec<f32>, n: usize, out: &mut Vec<f32>) -> Result<()> {
        let world = self.shard.world;
        let part = x.get(..n).ok_or_else(|| Error::shape("x", format!("at least {n} elements"), n, x.len()))?;
        if out.len() < world * n {
            return Err(Error::shape("out", format!("at least {world} × {n} elements"), world * n, out.len()));
        }
        self.meet(part.to_vec(), |parts| {
            for (chunk, p) in out.chunks_exact_mut(n.max(1)).zip(parts) {
                chunk.copy_from_slice(p);
            }
        })
    }

    fn abort(&self) {
        self.lock().aborted = true;
        self.meeting.changed.notify_all();
    }

    fn reset(&self) {
        let world = self.shard.world;
        *self.lock() = Round { parts: vec![None; world], ..Round::default() };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parallel::is_abort;

    /// Runs one all-reduce of `parts[rank]` on every rank of a new group at once; each rank's result.
    fn reduce_all(groups: &[ThreadGroup], parts: &[Vec<f32>]) -> Vec<Result<Vec<f32>>> {
        std::thread::scope(|scope| {
            let handles: Vec<_> = groups
                .iter()
                .zip(parts)
                .map(|(g, part)| {
                    scope.spawn(move || {
                        let mut x = part.clone();
                        g.all_reduce(&CpuBackend, &mut x, part.len()).map(|()| x)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().expect("rank thread")).collect()
        })
    }

    /// 1e8 + 1 rounds back to 1e8 in f32, so the rank order `(1e8 + 1) - 1e8` gives 0 where any order
    /// that adds the -1e8 first gives 1: every rank, every round, must give 0.
    #[test]
    fn every_rank_gets_the_rank_order_sum_every_round() {
        let groups = ThreadGroup::new(3).unwrap();
        let parts = vec![vec![1e8f32, 2.0], vec![1.0, 3.0], vec![-1e8, 4.0]];
        for round in 0..50 {
            for (rank, got) in reduce_all(&groups, &parts).into_iter().enumerate() {
                assert_eq!(got.unwrap(), vec![0.0, 9.0], "round {round}, rank {rank}");
            }
        }
    }

    #[test]
    fn an_abort_ends_a_waiting_rank_and_a_reset_readies_the_group() {
        let groups = ThreadGroup::new(2).unwrap();
        std::thread::scope(|scope| {
            let waiting = scope.spawn(|| groups[1].all_reduce(&CpuBackend, &mut vec![1.0], 1));
            std::thread::sleep(std::time::Duration::from_millis(20));
            groups[0].abort();
            let err = waiting.join().expect("rank thread").unwrap_err();
            assert!(is_abort(&err), "{err}");
        });
        groups.iter().for_each(|g| g.reset());
        let sums = reduce_all(&groups, &[vec![1.0], vec![2.0]]);
        assert!(sums.into_iter().all(|s| s.unwrap() == vec![3.0]));
    }

    #[test]
    fn ranks_reducing_different_lengths_are_an_error_not_a_wrong_sum() {
        let groups = ThreadGroup::new(2).unwrap();
        let results = reduce_all(&groups, &[vec![1.0, 2.0], vec![1.0]]);
        assert!(results.iter().any(|r| matches!(r, Err(Error::Param { name: "n", .. }))), "no length error");
        assert!(results.iter().all(|r| r.is_err()));
    }

    #[test]
    fn every_rank_gets_every_part_in_rank_order() {
        let groups = ThreadGroup::new(3).unwrap();
        let gathered: Vec<Vec<f32>> = std::thread::scope(|scope| {
            let handles: Vec<_> = groups
                .iter()
                .enumerate()
                .map(|(rank, g)| {
                    scope.spawn(move || {
                        let mut out = vec![0.0; 6];
                        g.all_gather(&CpuBackend, &vec![rank as f32, 10.0 + rank as f32, 99.0], 2, &mut out)
                            .map(|()| out)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().expect("rank thread").unwrap()).collect()
        });
        for out in gathered {
            assert_eq!(out, vec![0.0, 10.0, 1.0, 11.0, 2.0, 12.0]);
        }
    }

    #[test]
    fn a_group_needs_a_rank() {
        assert!(matches!(ThreadGroup::new(0), Err(Error::Param { name: "world", .. })));
    }
}
