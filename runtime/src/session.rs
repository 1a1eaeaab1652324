//! [`Session`]: a [`Program`] on a [`Device`], its regions allocated once.
//!
//! `feed` writes a batch into the input places, `step` enqueues the step's launches and the
//! copies of each next state into its slot and never waits, and results are read when asked for
//! (`read`), each read an explicit synchronisation that the session counts.

use std::collections::HashMap;

use crate::device::{Device, DeviceCounters, Regions};
use crate::program::{Program, Region, TensorRef};
use crate::value::HostTensor;
use crate::RuntimeError;

/// What a step cost, for `--stats`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StepStats {
    pub arena_bytes: u64,
    pub persistent_bytes: u64,
    pub launches_per_step: u64,
    /// Device allocations made by steps after the first.
    pub allocations_in_steps: u64,
    /// Host reads inside the last step (reads between steps, for results, are not counted).
    pub host_reads_per_step: u64,
    pub steps: u64,
}

pub struct Session<D: Device> {
    device: D,
    program: Program,
    regions: Regions<D::Memory>,
    stats: StepStats,
    /// Poison the arena before each step (debug builds: a launch that reads what nobody wrote
    /// reads NaN).
    poison: bool,
}

impl<D: Device> Session<D> {
    /// Allocates the regions and writes the persistent region's initial contents.
    pub fn new(mut device: D, program: Program) -> Result<Self, RuntimeError> {
        let mut regions = Regions {
            arena: device.alloc(Region::Arena, program.arena_bytes)?,
            persistent: device.alloc(Region::Persistent, program.persistent_bytes)?,
        };
        for (place, t) in &program.constants {
            let mut bytes = vec![0u8; t.bytes()];
            t.write_le_bytes(&mut bytes);
            device.write(&mut regions.persistent, place.offset, &bytes)?;
        }
        device.prepare(&program, &regions)?;
        let stats = StepStats {
            arena_bytes: program.arena_bytes,
            persistent_bytes: program.persistent_bytes,
            ..StepStats::default()
        };
        Ok(Session { device, program, regions, stats, poison: cfg!(debug_assertions) })
    }

    pub fn program(&self) -> &Program {
        &self.program
    }

    pub fn counters(&self) -> DeviceCounters {
        self.device.counters()
    }

    pub fn stats(&self) -> StepStats {
        self.stats
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

    fn write_at(&mut self, place: &TensorRef, t: &HostTensor) -> Result<(), RuntimeError> {
        let mut bytes = vec![0u8; t.bytes()];
        t.write_le_bytes(&mut bytes);
        self.device.write(self.regions.get_mut(place.region), place.offset, &bytes)
    }

    /// Writes a batch into the input places; every input must be fed before the first step.
    pub fn feed(&mut self, inputs: &HashMap<String, HostTensor>) -> Result<(), RuntimeError> {
        for name in inputs.keys() {
            if !self.program.inputs.iter().any(|(n, _)| n == name) {
                let all: Vec<&str> = self.program.inputs.iter().map(|(n, _)| n.as_str()).collect();
                return Err(RuntimeError::UnexpectedInput(name.clone(), all.join(", ")));
            }
        }
        for (name, place) in self.program.inputs.clone() {
            let t = inputs.get(&name).ok_or_else(|| RuntimeError::MissingInput(name.clone()))?;
            Self::check(&name, &place, t)?;
            self.write_at(&place, t)?;
        }
        Ok(())
    }

    /// Enqueues one step: every launch, then each next state into its state's slot.
    pub fn step(&mut self) -> Result<(), RuntimeError> {
        let before = self.device.counters();
        if self.poison {
            // Inputs are fed before the step: poison only what the step must write itself.
            let inputs: Vec<(TensorRef, Vec<u8>)> = self
                .program
                .inputs
                .iter()
                .map(|(_, p)| Ok((p.clone(), self.device.read(&self.regions.arena, p.offset, p.bytes())?)))
                .collect::<Result<_, RuntimeError>>()?;
            self.device.poison(&mut self.regions.arena)?;
            for (p, bytes) in inputs {
                self.device.write(&mut self.regions.arena, p.offset, &bytes)?;
            }
        }
        let after_poison = self.device.counters();
        for l in &self.program.launches {
            self.device.launch(&mut self.regions, l)?;
        }
        for s in &self.program.state {
            if s.next != s.slot {
                self.device.copy(&mut self.regions, &s.next, &s.slot)?;
            }
        }
        let after = self.device.counters();
        if self.stats.steps > 0 {
            self.stats.allocations_in_steps += after.allocations - before.allocations;
        }
        self.stats.launches_per_step = after.launches - after_poison.launches;
        self.stats.host_reads_per_step = after.host_reads - after_poison.host_reads;
        self.stats.steps += 1;
        Ok(())
    }

    /// Reads a graph output, input or persistent value (a weight, a state) by name.
    pub fn read(&mut self, name: &str) -> Result<HostTensor, RuntimeError> {
        let place =
            self.program.find(name).cloned().ok_or_else(|| RuntimeError::Graph(format!("no value `{name}`")))?;
        let bytes = self.device.read(self.regions.get(place.region), place.offset, place.bytes())?;
        Ok(HostTensor::from_le_bytes(place.dtype, place.shape.clone(), &bytes))
    }

    /// Replaces a persistent value (a checkpoint's state, trained weights).
    pub fn write(&mut self, name: &str, t: &HostTensor) -> Result<(), RuntimeError> {
        let place = self
            .program
            .persistent
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, p)| p.clone())
            .ok_or_else(|| RuntimeError::Graph(format!("`{name}` is not a weight or state of the program")))?;
        Self::check(name, &place, t)?;
        self.write_at(&place, t)
    }

    /// Feeds `inputs`, steps once and reads every output, in order.
    pub fn run(&mut self, inputs: &HashMap<String, HostTensor>) -> Result<Vec<(String, HostTensor)>, RuntimeError> {
        self.feed(inputs)?;
        self.step()?;
        let names: Vec<String> = self.program.outputs.iter().map(|(n, _)| n.clone()).collect();
        names.into_iter().map(|n| Ok((n.clone(), self.read(&n)?))).collect()
    }
}
