//! [`Session`]: programs on a [`Device`], sharing one state region.
//!
//! A session holds the state region (laid out by the [`StateLayout`] of its programs) and, for
//! each program it loaded, an arena and a constants region, all allocated when the program is
//! loaded. `feed` writes a batch into a program's input places, `step` enqueues its launches and
//! the copies of each next state into its slot and never waits, and results are read when asked
//! for (`read`), each read an explicit synchronisation that the device counts. Programs that share
//! the state (a training step at two batch sizes, the evaluation forward) see each other's
//! updates without anything passing through the host.

use std::collections::HashMap;

use crate::device::{Device, DeviceCounters, Regions};
use crate::program::{Program, Region, StateLayout, TensorRef};
use crate::value::HostTensor;
use crate::RuntimeError;

/// What steps cost, for `--stats`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StepStats {
    /// The largest arena of the loaded programs, and the state and constants bytes of all.
    pub arena_bytes: u64,
    pub state_bytes: u64,
    pub constants_bytes: u64,
    /// Launches of the program's last step.
    pub launches_per_step: u64,
    /// Device allocations made by steps after the session's first (of any program).
    pub allocations_in_steps: u64,
    /// Host reads inside the program's last step (reads between steps, for results, are not
    /// counted).
    pub host_reads_per_step: u64,
    /// The program's steps.
    pub steps: u64,
}

/// The time of one launch of a profiled step ([`Session::profile_step`]).
#[derive(Clone, Debug)]
pub struct LaunchTime {
    /// The node it comes from (`"name" (Op)`).
    pub node: String,
    /// The ONNX op type.
    pub op: String,
    /// Its first output's dtype.
    pub dtype: Option<mpc_ir::DType>,
    pub ms: f64,
    /// The least it moves: each tensor it reads or writes, once ([`crate::cost::launch_cost`]).
    pub bytes: u64,
}

/// Enqueues `launches`; an `If` reads its condition (the one host read a step may make, declared
/// by the program) and enqueues the branch it picks, then copies its results into place.
fn run_launches<D: Device>(
    device: &mut D,
    regions: &mut Regions<D::Memory>,
    launches: &[crate::program::Launch],
) -> Result<(), RuntimeError> {
    for l in launches {
        let Some(b) = &l.branches else {
            device.launch(regions, l)?;
            continue;
        };
        let cond = device.read(regions.get_mut(b.cond.region), b.cond.offset, b.cond.bytes())?;
        let taken = HostTensor::from_le_bytes(b.cond.dtype, b.cond.shape.clone(), &cond).f64s().first() != Some(&0.0);
        let (body, results) =
            if taken { (&b.then_launches, &b.then_outputs) } else { (&b.else_launches, &b.else_outputs) };
        run_launches(device, regions, body)?;
        for (from, to) in results.iter().zip(&l.outputs) {
            if from != to {
                device.copy(regions, from, to)?;
            }
        }
    }
    Ok(())
}

/// A value on its way to the host (see [`Session::read_later`]).
pub struct Pending<S> {
    place: TensorRef,
    staged: S,
}

/// Which loaded program.
pub type ProgramId = usize;

struct Loaded<M> {
    program: Program,
    arena: M,
    constants: M,
    /// Launches and host reads of this program's last step, and its steps.
    launches: u64,
    host_reads: u64,
    steps: u64,
    /// The recorded step, once recorded, and the launches it holds.
    recording: Option<(u64, u64)>,
}

pub struct Session<D: Device> {
    device: D,
    layout: StateLayout,
    state: D::Memory,
    programs: Vec<Loaded<D::Memory>>,
    stats: StepStats,
    /// Poison the arena before each step (debug builds: a launch that reads what nobody wrote
    /// reads NaN).
    poison: bool,
    /// Record a program's second step and replay it from then on, where the device records.
    capture: bool,
}

fn bytes_of(t: &HostTensor) -> Vec<u8> {
    let mut bytes = vec![0u8; t.bytes()];
    t.write_le_bytes(&mut bytes);
    bytes
}

/// Writes a graph tensor to its place; a narrowed weight copy is converted a piece at a time as
/// it is written.
fn write_tensor<D: Device>(
    device: &mut D,
    mem: &mut D::Memory,
    place: &TensorRef,
    t: &mpc_ir::Tensor,
) -> Result<(), RuntimeError> {
    let mut offset = place.offset;
    t.for_each_piece(|piece| {
        device.write(mem, offset, piece)?;
        offset += piece.len() as u64;
        Ok(())
    })
}

impl<D: Device> Session<D> {
    /// A session whose state is `program`'s, initialised from its graph; the program is loaded
    /// as program 0.
    pub fn new(mut device: D, program: Program) -> Result<Self, RuntimeError> {
        let layout = program.state_layout.clone();
        let mut state = device.alloc(Region::State, layout.bytes)?;
        for (place, t) in &program.state_init {
            write_tensor(&mut device, &mut state, place, t)?;
        }
        let mut s = Session {
            device,
            layout,
            state,
            programs: Vec::new(),
            stats: StepStats::default(),
            poison: cfg!(debug_assertions),
            capture: true,
        };
        s.load(program)?;
        Ok(s)
    }

    /// Loads another program over the same state (lowered with this session's layout).
    pub fn load(&mut self, program: Program) -> Result<ProgramId, RuntimeError> {
        if program.state_layout != self.layout {
            return Err(RuntimeError::Internal("a program lowered for another state layout".into()));
        }
        let arena = self.device.alloc(Region::Arena, program.arena_bytes)?;
        let mut constants = self.device.alloc(Region::Constants, program.constants_bytes)?;
        for (place, t) in &program.constants {
            write_tensor(&mut self.device, &mut constants, place, t)?;
        }
        let mut loaded = Loaded { program, arena, constants, launches: 0, host_reads: 0, steps: 0, recording: None };
        let mut regions =
            Regions { arena: &mut loaded.arena, state: &mut self.state, constants: &mut loaded.constants };
        self.device.prepare(&loaded.program, &mut regions)?;
        self.stats.arena_bytes = self.stats.arena_bytes.max(loaded.program.arena_bytes);
        self.stats.state_bytes = self.layout.bytes;
        self.stats.constants_bytes += loaded.program.constants_bytes;
        self.programs.push(loaded);
        Ok(self.programs.len() - 1)
    }

    fn loaded(&self, id: ProgramId) -> Result<&Loaded<D::Memory>, RuntimeError> {
        self.programs.get(id).ok_or_else(|| RuntimeError::Internal(format!("no program {id}")))
    }

    pub fn program(&self, id: ProgramId) -> Result<&Program, RuntimeError> {
        Ok(&self.loaded(id)?.program)
    }

    /// Whether steps are recorded once and replayed where the device can (the default is
    /// [`crate::device::capture`]); steps already recorded keep replaying.
    pub fn set_capture(&mut self, on: bool) {
        self.capture = on;
    }

    /// Enqueues a timing mark where the device makes them (see [`Device::mark`]).
    pub fn mark(&mut self) -> Result<Option<u64>, RuntimeError> {
        self.device.mark()
    }

    /// The device time between two marks, in milliseconds (waits for the second).
    pub fn elapsed_ms(&mut self, from: u64, to: u64) -> Result<f64, RuntimeError> {
        self.device.elapsed_ms(from, to)
    }

    /// The device memory in use as its driver reports it, where there is a driver.
    pub fn memory_in_use(&self) -> Option<u64> {
        self.device.memory_in_use()
    }

    pub fn layout(&self) -> &StateLayout {
        &self.layout
    }

    pub fn counters(&self) -> DeviceCounters {
        self.device.counters()
    }

    /// The device the session runs on.
    pub fn device(&self) -> &D {
        &self.device
    }

    /// What the session holds, and what the last step of program `id` did.
    pub fn stats(&self, id: ProgramId) -> StepStats {
        let mut s = self.stats;
        if let Some(l) = self.programs.get(id) {
            s.launches_per_step = l.launches;
            s.host_reads_per_step = l.host_reads;
            s.steps = l.steps;
        }
        s
    }

    fn check(name: &str, place: &TensorRef, t: &HostTensor) -> Result<(), RuntimeError> {
        if t.dtype() != place.dtype {
            return Err(RuntimeError::WrongDtype {
                name: name.into(),
                expected: place.dtype.to_string(),
                got: t.dtype().to_string(),
            });
        }
        if t.shape != place.shape {
            return Err(RuntimeError::WrongShape {
                name: name.into(),
                expected: format!("{:?}", place.shape),
                got: t.shape.clone(),
            });
        }
        Ok(())
    }

    /// Writes a batch into program `id`'s input places; every input must be fed before a step.
    pub fn feed(&mut self, id: ProgramId, inputs: &HashMap<String, HostTensor>) -> Result<(), RuntimeError> {
        let places = self.loaded(id)?.program.inputs.clone();
        for name in inputs.keys() {
            if !places.iter().any(|(n, _)| n == name) {
                let all: Vec<&str> = places.iter().map(|(n, _)| n.as_str()).collect();
                return Err(RuntimeError::UnexpectedInput(name.clone(), all.join(", ")));
            }
        }
        for (name, place) in places {
            let t = inputs.get(&name).ok_or_else(|| RuntimeError::MissingInput(name.clone()))?;
            Self::check(&name, &place, t)?;
            let arena = &mut self.programs[id].arena;
            self.device.write(arena, place.offset, &bytes_of(t))?;
        }
        Ok(())
    }

    /// Enqueues one step of program `id`: every launch, then each next state into its slot.
    pub fn step(&mut self, id: ProgramId) -> Result<(), RuntimeError> {
        let before = self.device.counters();
        let loaded = self.programs.get_mut(id).ok_or_else(|| RuntimeError::Internal(format!("no program {id}")))?;
        if self.poison {
            // Inputs are fed before the step: poison only what the step must write itself.
            let mut inputs = Vec::new();
            for (_, p) in &loaded.program.inputs {
                inputs.push((p.offset, self.device.read(&mut loaded.arena, p.offset, p.bytes())?));
            }
            self.device.poison(&mut loaded.arena)?;
            for (offset, bytes) in inputs {
                self.device.write(&mut loaded.arena, offset, &bytes)?;
            }
        }
        let after_poison = self.device.counters();
        if let Some((recording, launches)) = loaded.recording {
            self.device.replay(recording)?;
            self.stats.allocations_in_steps += self.device.counters().allocations - before.allocations;
            loaded.launches = launches;
            loaded.host_reads = 0;
            loaded.steps += 1;
            self.stats.steps += 1;
            return Ok(());
        }
        // The second step of a program with no host read inside is recorded, then replayed (the
        // first loads and warms what the device needs).
        let record =
            self.capture && loaded.steps == 1 && loaded.program.host_reads == 0 && self.device.begin_capture()?;
        let mut regions =
            Regions { arena: &mut loaded.arena, state: &mut self.state, constants: &mut loaded.constants };
        let enqueued = run_launches(&mut self.device, &mut regions, &loaded.program.launches).and_then(|()| {
            for s in &loaded.program.state {
                if s.next != s.slot {
                    self.device.copy(&mut regions, &s.next, &s.slot)?;
                }
            }
            Ok(())
        });
        if record {
            let recording = self.device.end_capture();
            enqueued?;
            let recording = recording?;
            let launches = self.device.counters().launches - after_poison.launches;
            loaded.recording = Some((recording, launches));
            self.device.replay(recording)?;
        } else {
            enqueued?;
        }
        let after = self.device.counters();
        if self.stats.steps > 0 {
            self.stats.allocations_in_steps += after.allocations - before.allocations;
        }
        let loaded = &mut self.programs[id];
        loaded.launches = after.launches - after_poison.launches;
        loaded.host_reads = after.host_reads - after_poison.host_reads;
        loaded.steps += 1;
        self.stats.steps += 1;
        Ok(())
    }

    /// Runs one step of program `id` as [`Session::step`] does (state updated, results in place),
    /// never recorded, and times each launch: on a device that marks its queue, the device time
    /// between marks enqueued before and after it (every mark is enqueued before the first is
    /// read, so the host's enqueueing overlaps the device's work; a launch shorter than the host's
    /// time to enqueue the next one shows that time too); else the host clock around it (the CPU
    /// runs a launch as it is enqueued). The copies of next states into their slots, where a
    /// state's next value is not written in place, are the last entry, `(state copies)`.
    pub fn profile_step(&mut self, id: ProgramId) -> Result<Vec<LaunchTime>, RuntimeError> {
        let before = self.device.counters();
        let loaded = self.programs.get_mut(id).ok_or_else(|| RuntimeError::Internal(format!("no program {id}")))?;
        let mut regions =
            Regions { arena: &mut loaded.arena, state: &mut self.state, constants: &mut loaded.constants };
        let device = &mut self.device;
        let mut marks = Vec::with_capacity(loaded.program.launches.len() + 2);
        let mut host = Vec::with_capacity(loaded.program.launches.len() + 1);
        marks.push(device.mark()?);
        for l in &loaded.program.launches {
            let t = std::time::Instant::now();
            run_launches(device, &mut regions, std::slice::from_ref(l))?;
            host.push(t.elapsed().as_secs_f64() * 1e3);
            marks.push(device.mark()?);
        }
        let copies = loaded.program.state.iter().any(|s| s.next != s.slot);
        if copies {
            let t = std::time::Instant::now();
            for s in &loaded.program.state {
                if s.next != s.slot {
                    device.copy(&mut regions, &s.next, &s.slot)?;
                }
            }
            host.push(t.elapsed().as_secs_f64() * 1e3);
            marks.push(device.mark()?);
        }
        let mut times = Vec::with_capacity(host.len());
        let last = copies.then_some(None);
        for (i, l) in loaded.program.launches.iter().map(Some).chain(last).enumerate() {
            let ms = match (marks[i], marks[i + 1]) {
                (Some(a), Some(b)) => device.elapsed_ms(a, b)?,
                _ => host[i],
            };
            times.push(match l {
                Some(l) => LaunchTime {
                    node: l.node.clone(),
                    op: l.kind(),
                    dtype: l.members()[0].outputs.first().map(|o| o.dtype),
                    ms,
                    bytes: crate::cost::launch_cost(l).bytes(),
                },
                None => {
                    // Each copy reads the next value and writes its slot.
                    let bytes =
                        loaded.program.state.iter().filter(|s| s.next != s.slot).map(|s| 2 * s.slot.bytes()).sum();
                    LaunchTime { node: "(state copies)".into(), op: "(state copies)".into(), dtype: None, ms, bytes }
                }
            });
        }
        let after = self.device.counters();
        let loaded = &mut self.programs[id];
        loaded.launches = after.launches - before.launches;
        loaded.host_reads = after.host_reads - before.host_reads;
        loaded.steps += 1;
        self.stats.steps += 1;
        Ok(times)
    }

    /// The device, and the place and memory of an output or input of program `id` or a state
    /// value (disjoint borrows of the session).
    fn place_of(&mut self, id: ProgramId, name: &str) -> Result<(&mut D, TensorRef, &mut D::Memory), RuntimeError> {
        let Session { device, programs, state, .. } = self;
        let loaded = programs.get_mut(id).ok_or_else(|| RuntimeError::Internal(format!("no program {id}")))?;
        let place =
            loaded.program.find(name).cloned().ok_or_else(|| RuntimeError::Graph(format!("no value `{name}`")))?;
        let mem = match place.region {
            Region::Arena => &mut loaded.arena,
            Region::State => state,
            Region::Constants => &mut loaded.constants,
        };
        Ok((device, place, mem))
    }

    /// Reads an output or input of program `id`, or a state value, by name.
    pub fn read(&mut self, id: ProgramId, name: &str) -> Result<HostTensor, RuntimeError> {
        let (device, place, mem) = self.place_of(id, name)?;
        let bytes = device.read(mem, place.offset, place.bytes())?;
        Ok(HostTensor::from_le_bytes(place.dtype, place.shape.clone(), &bytes))
    }

    /// Enqueues a copy of an output (or input, or state value) of program `id` to the host, to be
    /// read with [`Session::wait`] later: no synchronisation now.
    pub fn read_later(&mut self, id: ProgramId, name: &str) -> Result<Pending<D::Staged>, RuntimeError> {
        let (device, place, mem) = self.place_of(id, name)?;
        let staged = device.stage(mem, place.offset, place.bytes())?;
        Ok(Pending { place, staged })
    }

    /// Waits for a value staged by [`Session::read_later`].
    pub fn wait(&mut self, p: Pending<D::Staged>) -> Result<HostTensor, RuntimeError> {
        let bytes = self.device.fetch(p.staged)?;
        Ok(HostTensor::from_le_bytes(p.place.dtype, p.place.shape, &bytes))
    }

    /// Reads a state value by name.
    pub fn read_state(&mut self, name: &str) -> Result<HostTensor, RuntimeError> {
        let place = self.layout.find(name).cloned().ok_or_else(|| RuntimeError::Graph(format!("no state `{name}`")))?;
        let bytes = self.device.read(&mut self.state, place.offset, place.bytes())?;
        Ok(HostTensor::from_le_bytes(place.dtype, place.shape.clone(), &bytes))
    }

    /// Replaces a state value (a checkpoint's, trained weights).
    pub fn write_state(&mut self, name: &str, t: &HostTensor) -> Result<(), RuntimeError> {
        let place = self
            .layout
            .find(name)
            .cloned()
            .ok_or_else(|| RuntimeError::Graph(format!("`{name}` is not a state value of the program")))?;
        Self::check(name, &place, t)?;
        self.device.write(&mut self.state, place.offset, &bytes_of(t))
    }

    /// Feeds program 0, steps once and reads every output, in order.
    pub fn run(&mut self, inputs: &HashMap<String, HostTensor>) -> Result<Vec<(String, HostTensor)>, RuntimeError> {
        self.feed(0, inputs)?;
        self.step(0)?;
        let names: Vec<String> = self.programs[0].program.outputs.iter().map(|(n, _)| n.clone()).collect();
        names.into_iter().map(|n| Ok((n.clone(), self.read(0, &n)?))).collect()
    }
}
