//! What one evaluation of an expression can cost at worst, estimated from its tree the way
//! Kubernetes estimates its CEL rules' cost: every variable has a worst-case size, a
//! comprehension multiplies its body's cost by its range's worst-case number of elements,
//! concatenations and literals add sizes, and work on strings and lists costs in proportion to
//! their size. Two figures are bounded: the cost (in steps: one per node evaluated, plus one
//! per [`BYTES_PER_STEP`] bytes scanned or copied) and the size of the result (bytes built).
//!
//! A comprehension nested in another and ranging over the outer one's element
//! (`json.a.all(x, x.b.exists(y, ...))`) is not charged the product of both ranges: the
//! elements of one JSON value are disjoint parts of it, so the inner loops together visit at
//! most as many elements as the outer range holds. Such work is carried as `part_*` until the
//! comprehension whose range it divides.

use cel::common::ast::{ComprehensionExpr, EntryExpr, Expr, IdedExpr, LiteralValue};

use super::PAYLOAD_MAX_BYTES;

/// Bytes scanned, compared or copied per step.
pub const BYTES_PER_STEP: u64 = 64;

/// What one evaluation may cost, in steps.
pub const COST_BUDGET: u64 = 5_000_000;

/// The largest result an expression may build, in bytes.
pub const RESULT_BUDGET_BYTES: u64 = 4 << 20;

/// The longest MQTT topic (an MQTT string).
pub const TOPIC_MAX_BYTES: u64 = 65_535;

/// The most levels a topic has: every other byte a `/`.
pub const LEVELS_MAX: u64 = TOPIC_MAX_BYTES.div_ceil(2);

/// The largest MQTT packet, which bounds a message's user properties together.
pub const MQTT_PACKET_MAX_BYTES: u64 = 268_435_455;

/// What a `matches` call costs beyond its scan, in steps: finding the compiled pattern (the
/// patched crate compiles each once per thread, see third_party/cel/FERRY-PATCH.md).
const REGEX_CALL_STEPS: u64 = 100;

/// A scalar's size (an int, a bool, a timestamp).
const SCALAR_BYTES: u64 = 8;

/// The longest string a scalar converts to.
const SCALAR_STRING_BYTES: u64 = 32;

/// What a compiled expression costs at worst.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cost {
    /// Steps of one evaluation.
    pub steps: u64,
    /// Bytes of its result.
    pub result_bytes: u64,
}

/// The worst case of one node: its value's size and the work to compute it.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Estimate {
    /// Steps independent of the enclosing comprehension's element.
    cost: u64,
    /// Steps in proportion to the enclosing comprehension's element: together, over all its
    /// iterations, at most this.
    part_cost: u64,
    /// Bytes of the value.
    bytes: u64,
    /// Bytes of the value that are (copies of) the enclosing comprehension's element.
    part_bytes: u64,
    /// Elements, when iterated.
    items: u64,
    /// Bytes of one element or field.
    elem_bytes: u64,
    /// Elements of one element or field.
    elem_items: u64,
    /// A map whose lookups cost one step.
    map: bool,
}

impl Estimate {
    fn scalar() -> Self {
        Self::sized(SCALAR_BYTES, 0, 0)
    }

    fn sized(bytes: u64, items: u64, elem_bytes: u64) -> Self {
        Self {
            cost: 1,
            bytes,
            items,
            elem_bytes,
            ..Self::default()
        }
    }

    /// A value whose elements are of `elem_items` elements themselves.
    fn nested(self, elem_items: u64) -> Self {
        Self { elem_items, ..self }
    }

    fn total_bytes(&self) -> u64 {
        self.bytes.saturating_add(self.part_bytes)
    }

    /// Adds `other`'s work to this one's.
    fn plus_work(mut self, other: &Estimate) -> Self {
        self.cost = self.cost.saturating_add(other.cost);
        self.part_cost = self.part_cost.saturating_add(other.part_cost);
        self
    }

    /// Charges scanning or copying `operands`: their bytes, and each of their elements (a
    /// copy of a list or map copies every element).
    fn scanning(mut self, operands: &[Estimate]) -> Self {
        for o in operands {
            let steps = |bytes: u64| (bytes / BYTES_PER_STEP).saturating_add(o.items.min(bytes));
            if o.part_bytes > 0 {
                self.part_cost = self.part_cost.saturating_add(steps(o.total_bytes()));
            } else {
                self.cost = self.cost.saturating_add(steps(o.bytes));
            }
        }
        self
    }

    pub(super) fn cost(&self) -> Cost {
        Cost {
            steps: self.cost.saturating_add(self.part_cost),
            result_bytes: self.total_bytes(),
        }
    }
}

/// The worst-case size of each variable, by name, for payloads of at most `payload` bytes.
pub(super) fn variable(name: &str, payload: u64) -> Estimate {
    match name {
        // Strings and bytes have no elements: CEL does not iterate them.
        "topic" | "contentType" => Estimate::sized(TOPIC_MAX_BYTES, 0, 1),
        "levels" => Estimate::sized(TOPIC_MAX_BYTES, LEVELS_MAX, TOPIC_MAX_BYTES),
        "payload" => Estimate::sized(payload, 0, 1),
        // The smallest JSON element is one digit and a comma.
        "json" => Estimate::sized(payload, payload / 2, payload).nested(payload / 2),
        // A property is at least an identifier byte and two lengths; each name and value is
        // an MQTT string.
        "properties" => Estimate {
            map: true,
            ..Estimate::sized(
                MQTT_PACKET_MAX_BYTES,
                MQTT_PACKET_MAX_BYTES / 5,
                TOPIC_MAX_BYTES,
            )
        },
        _ => Estimate::scalar(),
    }
}

/// The estimate of a comprehension's own variables, in scope of its body.
struct Bound<'a> {
    name: &'a str,
    estimate: Estimate,
}

/// Estimates expression trees that [`super::Check`] accepted.
pub(super) struct Estimator<'a> {
    bound: Vec<Bound<'a>>,
    /// The largest payload the expression can see, in bytes.
    payload: u64,
}

impl<'a> Estimator<'a> {
    pub(super) fn new(payload_bytes: usize) -> Self {
        Self {
            bound: Vec::new(),
            payload: payload_bytes.min(PAYLOAD_MAX_BYTES) as u64,
        }
    }

    pub(super) fn expr(&mut self, e: &'a IdedExpr) -> Estimate {
        match &e.expr {
            Expr::Literal(l) => match l {
                LiteralValue::String(s) => Estimate::sized(s.len() as u64, 0, 1),
                LiteralValue::Bytes(b) => Estimate::sized(b.len() as u64, 0, 1),
                _ => Estimate::scalar(),
            },
            Expr::Ident(name) => self.ident(name),
            Expr::Select(s) => {
                let operand = self.expr(&s.operand);
                if s.test {
                    return Estimate::scalar().plus_work(&operand);
                }
                element(&operand).plus_work(&operand)
            }
            Expr::Call(call) => {
                let target = call.target.as_deref().map(|t| self.expr(t));
                let args: Vec<Estimate> = call.args.iter().map(|a| self.expr(a)).collect();
                let operands: Vec<Estimate> = target.into_iter().chain(args).collect();
                call_estimate(&call.func_name, &call.args, &operands)
            }
            Expr::List(list) => {
                let elements: Vec<Estimate> = list.elements.iter().map(|x| self.expr(x)).collect();
                collection(&elements, false)
            }
            Expr::Map(map) => {
                let mut parts = Vec::new();
                for entry in &map.entries {
                    match &entry.expr {
                        EntryExpr::MapEntry(m) => {
                            parts.push(self.expr(&m.key));
                            parts.push(self.expr(&m.value));
                        }
                        EntryExpr::StructField(f) => parts.push(self.expr(&f.value)),
                    }
                }
                let mut out = collection(&parts, true);
                out.items = map.entries.len() as u64;
                out
            }
            Expr::Comprehension(c) => self.comprehension(c),
            Expr::Struct(_) | Expr::Unspecified => Estimate::scalar(),
        }
    }

    fn ident(&self, name: &str) -> Estimate {
        match self.bound.iter().rev().find(|b| b.name == name) {
            Some(b) => Estimate {
                cost: 1,
                part_cost: 0,
                ..b.estimate
            },
            None => variable(name, self.payload),
        }
    }

    fn comprehension(&mut self, c: &'a ComprehensionExpr) -> Estimate {
        let range = self.expr(&c.iter_range);
        let init = self.expr(&c.accu_init);
        // Within one of the enclosing comprehension's elements: its loops, over all of that
        // comprehension's iterations, visit that comprehension's range once.
        let within_part = range.part_bytes > 0;
        let literal_range = matches!(c.iter_range.expr, Expr::List(_));
        let element = if literal_range {
            // Literals: not part of anything the message holds.
            Estimate::sized(range.elem_bytes, range.elem_bytes, range.elem_bytes)
        } else {
            let whole = range.total_bytes();
            Estimate {
                cost: 1,
                part_cost: 0,
                bytes: 0,
                part_bytes: range.elem_bytes.min(whole).max(1),
                items: range.elem_items,
                elem_bytes: range.elem_bytes,
                elem_items: range.elem_items,
                map: false,
            }
        };
        let mark = self.bound.len();
        self.bound.push(Bound {
            name: &c.iter_var,
            estimate: element,
        });
        if let Some(second) = &c.iter_var2 {
            self.bound.push(Bound {
                name: second,
                estimate: element,
            });
        }
        self.bound.push(Bound {
            name: &c.accu_var,
            estimate: init,
        });
        let condition = self.expr(&c.loop_cond);
        let step = self.expr(&c.loop_step);
        let iterations = range.items;
        // Each step adds (at most) what it built beyond the accumulator it was given.
        let grows = step.bytes.saturating_sub(init.bytes);
        let grows_part = step.part_bytes.saturating_sub(init.part_bytes);
        let built = iterations.saturating_mul(grows).saturating_add(grows_part);
        // Each iteration copies its element: the range, once over.
        let copies = Estimate::default().scanning(&[range]);
        let loops = iterations
            .saturating_mul(condition.cost.saturating_add(step.cost).saturating_add(1))
            .saturating_add(copies.cost)
            .saturating_add(copies.part_cost)
            .saturating_add(condition.part_cost)
            .saturating_add(step.part_cost);
        let accumulated = Estimate {
            cost: 1,
            part_cost: 0,
            bytes: if within_part {
                0
            } else {
                init.bytes.saturating_add(built)
            },
            part_bytes: if within_part {
                init.total_bytes().saturating_add(built)
            } else {
                0
            },
            items: init.items.saturating_add(iterations),
            elem_bytes: init.elem_bytes.max(step.elem_bytes),
            elem_items: init.elem_items.max(step.elem_items),
            map: false,
        };
        if let Some(accu) = self.bound.last_mut() {
            accu.estimate = accumulated;
        }
        let result = self.expr(&c.result);
        self.bound.truncate(mark);
        let fixed = range
            .cost
            .saturating_add(init.cost)
            .saturating_add(result.cost);
        let (cost, part_cost) = if within_part {
            (
                fixed,
                range
                    .part_cost
                    .saturating_add(loops)
                    .saturating_add(result.part_cost),
            )
        } else {
            (
                fixed.saturating_add(loops).saturating_add(result.part_cost),
                range.part_cost,
            )
        };
        Estimate {
            cost,
            part_cost,
            ..result
        }
    }
}

/// One element or field of `operand` (`x.f`, `x[i]`).
fn element(operand: &Estimate) -> Estimate {
    let elem = operand.elem_bytes;
    let (bytes, part_bytes) = if operand.part_bytes > 0 {
        (0, elem.min(operand.part_bytes))
    } else {
        (elem, 0)
    };
    Estimate {
        cost: 1,
        part_cost: 0,
        bytes,
        part_bytes,
        items: operand.elem_items,
        elem_bytes: elem,
        elem_items: operand.elem_items,
        map: false,
    }
}

/// A list or map literal of `parts`.
fn collection(parts: &[Estimate], map: bool) -> Estimate {
    let mut out = Estimate {
        cost: 1,
        items: parts.len() as u64,
        map,
        ..Estimate::default()
    }
    .scanning(parts);
    for p in parts {
        out = out.plus_work(p);
        out.bytes = out
            .bytes
            .saturating_add(p.bytes)
            .saturating_add(SCALAR_BYTES);
        out.part_bytes = out.part_bytes.saturating_add(p.part_bytes);
        out.elem_bytes = out.elem_bytes.max(p.total_bytes());
        out.elem_items = out.elem_items.max(p.items);
    }
    out
}

/// A call of `name` on `operands` (the target first); `args` as written, for literals.
fn call_estimate(name: &str, args: &[IdedExpr], operands: &[Estimate]) -> Estimate {
    let work = operands
        .iter()
        .fold(Estimate::default(), |acc, o| acc.plus_work(o));
    let own = |e: Estimate| Estimate {
        cost: e.cost.saturating_add(work.cost),
        part_cost: e.part_cost.saturating_add(work.part_cost),
        ..e
    };
    match (name, operands) {
        // Short-circuits: at most the condition and the costlier branch.
        ("_?_:_", [condition, a, b]) => Estimate {
            cost: condition
                .cost
                .saturating_add(a.cost.max(b.cost))
                .saturating_add(1),
            part_cost: condition
                .part_cost
                .saturating_add(a.part_cost.max(b.part_cost)),
            bytes: a.bytes.max(b.bytes),
            part_bytes: a.part_bytes.max(b.part_bytes),
            items: a.items.max(b.items),
            elem_bytes: a.elem_bytes.max(b.elem_bytes),
            elem_items: a.elem_items.max(b.elem_items),
            map: a.map && b.map,
        },
        (
            "_&&_" | "_||_" | "!_" | "-_" | "size" | "type" | "has" | "_-_" | "_*_" | "_/_" | "_%_",
            _,
        ) => own(Estimate::scalar()),
        ("_+_", [a, b]) if is_scalar(a) && is_scalar(b) => own(Estimate::scalar()),
        ("@in", [_, container]) if container.map => own(Estimate::scalar()),
        // A comparison stops at the shorter operand (an element's part of the enclosing
        // comprehension's range bounds it over all iterations).
        ("_==_" | "_!=_" | "_<_" | "_<=_" | "_>_" | "_>=_", [a, b]) => {
            let shorter = match (a.part_bytes > 0, b.part_bytes > 0) {
                (true, _) => a,
                (_, true) => b,
                _ if a.bytes <= b.bytes => a,
                _ => b,
            };
            own(Estimate::scalar()).scanning(&[*shorter])
        }
        // A search scans its operands, and answers a bool.
        ("@in" | "contains" | "startsWith" | "endsWith", _) => {
            own(Estimate::scalar()).scanning(operands)
        }
        // Concatenation copies both sides.
        ("_+_", [a, b]) => own(Estimate {
            cost: 1,
            part_cost: 0,
            bytes: a.bytes.saturating_add(b.bytes),
            part_bytes: a.part_bytes.saturating_add(b.part_bytes),
            items: a.items.saturating_add(b.items),
            elem_bytes: a.elem_bytes.max(b.elem_bytes),
            elem_items: a.elem_items.max(b.elem_items),
            map: false,
        })
        .scanning(operands),
        ("_[_]", [operand, _]) => own(element(operand)),
        // A pattern costs in proportion to the text times the pattern.
        ("matches", _) => {
            let pattern = match args.last().map(|a| &a.expr) {
                Some(Expr::Literal(LiteralValue::String(p))) => p.len() as u64,
                _ => 1,
            };
            let text = operands.first().copied().unwrap_or_default();
            let mut e = own(Estimate::scalar()).scanning(&[text]);
            e.cost = e.cost.saturating_add(REGEX_CALL_STEPS);
            let factor = 1 + pattern / 16;
            e.cost = e
                .cost
                .saturating_add((text.bytes / BYTES_PER_STEP).saturating_mul(factor));
            e.part_cost = e
                .part_cost
                .saturating_add((text.part_bytes / BYTES_PER_STEP).saturating_mul(factor));
            e
        }
        // A scalar written as a string: at most 32 bytes (a timestamp in RFC 3339).
        ("string", [operand]) if is_scalar(operand) => {
            own(Estimate::sized(SCALAR_STRING_BYTES, 0, 1))
        }
        // Conversions, timestamps, durations: a scan of the operands, and a result no larger
        // than they are.
        _ => {
            let bytes = operands
                .iter()
                .map(|o| o.bytes)
                .fold(0u64, u64::saturating_add);
            let part_bytes = operands
                .iter()
                .map(|o| o.part_bytes)
                .fold(0u64, u64::saturating_add);
            own(Estimate {
                cost: 1,
                part_cost: 0,
                bytes: bytes.max(SCALAR_BYTES),
                part_bytes,
                items: operands
                    .iter()
                    .map(|o| o.items)
                    .fold(0, u64::saturating_add),
                elem_bytes: operands.iter().map(|o| o.elem_bytes).max().unwrap_or(0),
                elem_items: operands.iter().map(|o| o.elem_items).max().unwrap_or(0),
                map: false,
            })
            .scanning(operands)
        }
    }
}

fn is_scalar(e: &Estimate) -> bool {
    e.items == 0 && e.total_bytes() <= SCALAR_BYTES
}
