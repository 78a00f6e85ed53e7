//! Evaluating a rule's CEL expressions (`ferry_api::expr`) on one message: the variables are
//! bound on first use, `json` is parsed at most once per message, and each result is checked
//! against what its field needs. A failure is a value, never a panic: the pipeline sends the
//! message to the target's dead-letter path with the error.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::SystemTime;

use cel::common::types::{
    CelBool, CelDouble, CelInt, CelList, CelMap, CelMapKey, CelNull, CelString,
};
use cel::common::value::Val;
use cel::objects::{Key, Map};
use cel::{Context, Value};
use ferry_api::expr::{COST_BUDGET, ENV, Expression, JsonReads, PAYLOAD_MAX_BYTES, VARIABLES};
use ferry_api::validate_kafka_topic;
use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

use crate::mqtt::Message;
use crate::window::PermanentReason;

/// Why an expression gave no usable result for a message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EvalError {
    /// `invalid_json` (the payload does not parse, and the expression reads `json`) or
    /// `expression` (the evaluation failed, or returned the wrong type).
    pub reason: PermanentReason,
    pub message: String,
}

/// One message's variables, bound as expressions need them.
pub struct Scope<'m> {
    message: &'m Message,
    /// What of the payload's JSON the expressions to evaluate read (all of it when `None`).
    json_reads: Option<Arc<JsonReads>>,
    received_at: SystemTime,
    context: Context<'static, 'static>,
    /// The variables bound so far (bit i: `VARIABLES[i]`).
    bound: u32,
    /// Why `json` could not be bound, once tried.
    json_error: Option<String>,
    /// Why `payload` could not be bound (too large), once tried.
    payload_error: Option<String>,
    /// Steps its evaluations used so far (counted by the CEL interpreter).
    steps: u64,
    /// Steps left to the target being evaluated: one rule's expressions together (a filter, a
    /// topic, a key, a transform, 25 headers) get one evaluation's budget per message, so that
    /// no rule costs a message more than that, however many expressions it has.
    target_left: u64,
    /// Steps left to this message's evaluations together before they must move off the
    /// runtime's thread ([`Scope::overran`]); `u64::MAX` where they may take their budgets.
    inline_left: u64,
    /// Whether an evaluation was stopped by `inline_left` rather than by a budget.
    overran: bool,
}

impl<'m> Scope<'m> {
    /// `json_reads`: what the expressions it will evaluate read of `json`, together
    /// ([`JsonReads::union`]); `json` holds only that.
    pub fn new(
        message: &'m Message,
        json_reads: Option<Arc<JsonReads>>,
        received_at: SystemTime,
    ) -> Self {
        Self {
            message,
            json_reads,
            received_at,
            context: Context::with_env(Arc::clone(&ENV)),
            bound: 0,
            json_error: None,
            payload_error: None,
            steps: 0,
            target_left: COST_BUDGET,
            inline_left: u64::MAX,
            overran: false,
        }
    }

    /// Stops evaluating once the message's evaluations together took `steps`: the caller then
    /// evaluates it again, from the start, where a long evaluation holds up nothing else.
    pub fn inline_only(mut self, steps: u64) -> Self {
        self.inline_left = steps;
        self
    }

    /// Whether an evaluation stopped at the [`Scope::inline_only`] limit: what was evaluated
    /// is incomplete and must be thrown away.
    pub fn overran(&self) -> bool {
        self.overran
    }

    /// Starts the evaluations of another target: it gets a whole budget of its own.
    pub fn begin_target(&mut self) {
        self.target_left = COST_BUDGET;
    }

    /// Steps its evaluations used so far.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// Evaluates `e`; `field` names it in errors (`filter`, `kafka.key.expression`, ...).
    pub fn eval(&mut self, e: &Expression, field: &str) -> Result<Value, EvalError> {
        let missing = e.uses_mask() & !self.bound;
        if missing != 0 {
            for (i, variable) in VARIABLES.iter().enumerate() {
                if missing & (1 << i) != 0 {
                    self.bind(variable.name);
                }
            }
            self.bound |= missing;
        }
        let unbound = [
            ("json", &self.json_error, PermanentReason::InvalidJson),
            ("payload", &self.payload_error, PermanentReason::Expression),
        ];
        for (name, error, reason) in unbound {
            if let Some(error) = error
                && e.uses(name)
            {
                return Err(EvalError {
                    reason,
                    message: format!("{field} reads {name}, but {error}"),
                });
            }
        }
        // The estimate bounds what an accepted expression costs; the budget stops, as this
        // message's failure, whatever it missed.
        let budget = self.target_left;
        let inline_capped = self.inline_left < budget;
        let (result, steps) = cel::budget::with_budget(self.inline_left.min(budget), || {
            e.program().execute(&self.context)
        });
        self.steps = self.steps.saturating_add(steps);
        self.target_left = self.target_left.saturating_sub(steps);
        self.inline_left = self.inline_left.saturating_sub(steps);
        result.map_err(|error| match error {
            cel::ExecutionError::CostLimitExceeded if inline_capped => {
                self.overran = true;
                failed(field, "stopped to be evaluated off the runtime's thread")
            }
            cel::ExecutionError::CostLimitExceeded if budget < COST_BUDGET => failed(
                field,
                &format!(
                    "the rule's expressions together exceeded their budget of {COST_BUDGET} \
                     steps on this message ({} were left for this one, whose estimate at worst \
                     was {})",
                    budget,
                    e.cost().steps
                ),
            ),
            cel::ExecutionError::CostLimitExceeded => failed(
                field,
                &format!(
                    "the evaluation exceeded its budget of {COST_BUDGET} steps (its estimate at \
                     worst was {})",
                    e.cost().steps
                ),
            ),
            error => failed(field, &error.to_string()),
        })
    }

    pub fn filter(&mut self, e: &Expression) -> Result<bool, EvalError> {
        match self.eval(e, "filter")? {
            Value::Bool(b) => Ok(b),
            other => Err(failed("filter", &wrong_type(&other, "a bool"))),
        }
    }

    /// A key or header value: string or bytes; `null` for none.
    pub fn bytes(&mut self, e: &Expression, field: &str) -> Result<Option<Vec<u8>>, EvalError> {
        match self.eval(e, field)? {
            Value::String(s) => Ok(Some(s.as_bytes().to_vec())),
            Value::Bytes(b) => Ok(Some(b.as_ref().clone())),
            Value::Null => Ok(None),
            other => Err(failed(
                field,
                &wrong_type(&other, "a string, bytes or null"),
            )),
        }
    }

    /// A Kafka topic name, checked like a template's result.
    pub fn topic(&mut self, e: &Expression) -> Result<String, EvalError> {
        let field = "kafka.topic_expression";
        match self.eval(e, field)? {
            Value::String(s) => match validate_kafka_topic(&s) {
                Ok(()) => Ok(s.as_ref().clone()),
                Err(why) => Err(failed(
                    field,
                    &format!("{s:?} is not a valid Kafka topic name: it {why}"),
                )),
            },
            other => Err(failed(field, &wrong_type(&other, "a string"))),
        }
    }

    /// The record value: the result written as JSON.
    pub fn transform(&mut self, e: &Expression) -> Result<Vec<u8>, EvalError> {
        let field = "payload.transform";
        let value = self.eval(e, field)?;
        let json = value
            .json()
            .map_err(|error| failed(field, &format!("cannot be written as JSON: {error}")))?;
        serde_json::to_vec(&json)
            .map_err(|error| failed(field, &format!("cannot be written as JSON: {error}")))
    }

    fn bind(&mut self, name: &'static str) {
        let m = self.message;
        let value = match name {
            "topic" => Value::from(m.topic.as_str()),
            "levels" => Value::List(Arc::new(m.topic.split('/').map(Value::from).collect())),
            "qos" => Value::Int(i64::from(m.qos)),
            "retain" => Value::Bool(m.retain),
            "properties" => {
                let map: HashMap<Key, Value> = m
                    .user_properties
                    .iter()
                    .map(|(k, v)| (Key::from(k.as_str()), Value::from(v.as_str())))
                    .collect();
                Value::Map(Map { map: Arc::new(map) })
            }
            "contentType" => Value::from(m.content_type.as_deref().unwrap_or_default()),
            "payload" if m.payload.len() > PAYLOAD_MAX_BYTES => {
                self.payload_error = Some(too_large(m.payload.len()));
                Value::Null
            }
            "payload" => Value::Bytes(Arc::new(m.payload.to_vec())),
            "receivedAt" => {
                Value::Timestamp(chrono::DateTime::<chrono::Utc>::from(self.received_at).into())
            }
            "json" => {
                let reads = self.json_reads.as_deref().unwrap_or(&JsonReads::Whole);
                let parsed = parse_json(&m.payload, reads);
                let parsed = parsed.unwrap_or_else(|error| {
                    self.json_error = Some(error);
                    Box::new(CelNull)
                });
                self.context.add_variable_as_val(name, parsed);
                return;
            }
            _ => Value::Null,
        };
        self.context.add_variable_from_value(name, value);
    }
}

/// What a target's expressions made of one message, to build its record from.
#[derive(Debug, Default)]
pub struct Evaluated {
    /// From `kafka.topic_expression`.
    pub topic: Option<String>,
    /// From `kafka.key.expression`: `None` for no key.
    pub key: Option<Vec<u8>>,
    /// From `kafka.headers.expressions`, those that were not `null`.
    pub headers: Vec<(String, Vec<u8>)>,
    /// From `payload.transform`.
    pub value: Option<Vec<u8>>,
    /// The first expression that failed (a filter's included): the record cannot be built.
    pub error: Option<EvalError>,
}

impl Evaluated {
    pub fn failed(error: EvalError) -> Self {
        Self {
            error: Some(error),
            ..Self::default()
        }
    }
}

/// librdkafka's default `message.max.bytes`: the largest record a producer sends.
pub const RECORD_MAX_BYTES: usize = 1_000_000;

/// Evaluates the expressions of a target's record (not its rules' filters). A record whose
/// key, headers and value built by expressions come to more than `max_bytes` (the producer's
/// `message.max.bytes`) could never be written: it fails as this record's failure, and what
/// was built is not kept.
pub fn record(
    scope: &mut Scope<'_>,
    topic: Option<&Expression>,
    e: &ferry_api::RuleExpressions,
    max_bytes: usize,
) -> Evaluated {
    let mut out = Evaluated::default();
    if let Err(error) = record_parts(scope, topic, e, &mut out) {
        return Evaluated::failed(error);
    }
    let built = out.key.as_ref().map_or(0, Vec::len)
        + out
            .headers
            .iter()
            .map(|(name, value)| name.len() + value.len())
            .sum::<usize>()
        + out.value.as_ref().map_or(0, Vec::len);
    if built > max_bytes {
        return Evaluated::failed(EvalError {
            reason: PermanentReason::Expression,
            message: format!(
                "the record's expressions (key, headers, transform) built {built} bytes, more than \
                 the {max_bytes} bytes of the producer's message.max.bytes: it could never be written"
            ),
        });
    }
    out
}

/// The producer's `message.max.bytes` in `config` (librdkafka's default when not set).
pub fn record_max_bytes(config: &std::collections::BTreeMap<String, String>) -> usize {
    config
        .get("message.max.bytes")
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(RECORD_MAX_BYTES)
}

fn record_parts(
    scope: &mut Scope<'_>,
    topic: Option<&Expression>,
    e: &ferry_api::RuleExpressions,
    out: &mut Evaluated,
) -> Result<(), EvalError> {
    if let Some(t) = topic {
        out.topic = Some(scope.topic(t)?);
    }
    if let Some(k) = &e.key {
        out.key = scope.bytes(k, "kafka.key.expression")?;
    }
    for (name, h) in &e.headers {
        let field = format!("kafka.headers.expressions.{name}");
        if let Some(value) = scope.bytes(h, &field)? {
            out.headers.push((name.clone(), value));
        }
    }
    if let Some(t) = &e.transform {
        out.value = Some(scope.transform(t)?);
    }
    Ok(())
}

/// Names the field, not the expression's text: in a standalone config that text may hold a
/// substituted `${VAR}`, and this message goes into `ferry.error`, logs and `/status`.
fn failed(field: &str, error: &str) -> EvalError {
    EvalError {
        reason: PermanentReason::Expression,
        message: format!("{field} failed: {error}"),
    }
}

fn too_large(bytes: usize) -> String {
    format!(
        "the payload ({bytes} bytes) is larger than the {PAYLOAD_MAX_BYTES} bytes expressions read"
    )
}

fn wrong_type(value: &Value, wanted: &str) -> String {
    // CEL's names for the types (the crate calls a double `float`).
    let kind = match value {
        Value::Int(_) => "an int",
        Value::UInt(_) => "a uint",
        Value::Float(_) => "a double",
        Value::String(_) => "a string",
        Value::Bytes(_) => "bytes",
        Value::Bool(_) => "a bool",
        Value::List(_) => "a list",
        Value::Map(_) => "a map",
        Value::Null => "null",
        Value::Timestamp(_) => "a timestamp",
        Value::Duration(_) => "a duration",
        _ => "a value of another type",
    };
    format!("returned {kind}, not {wanted}")
}

/// What `reads` asks of the payload as CEL values, numbers as CEL's JSON mapping would have
/// them but without losing integers: a number without a fraction that fits is an `int`, any
/// other a `double`. The whole payload must be JSON (in UTF-8); fields nobody reads are checked
/// but never built. Parsed straight into CEL's values, with no intermediate tree: this is most
/// of what a rule that reads `json` costs per message.
pub fn parse_json(payload: &[u8], reads: &JsonReads) -> Result<Box<dyn Val>, String> {
    if payload.len() > PAYLOAD_MAX_BYTES {
        return Err(too_large(payload.len()));
    }
    let not_json = |error: &dyn std::fmt::Display| format!("the payload is not JSON: {error}");
    // Checked here because skipping a string does not check it.
    let text = std::str::from_utf8(payload).map_err(|e| not_json(&e))?;
    let mut parser = serde_json::Deserializer::from_str(text);
    let value = JsonSeed(reads)
        .deserialize(&mut parser)
        .and_then(|v| parser.end().map(|()| v))
        .map_err(|e| not_json(&e))?;
    Ok(value)
}

/// Builds the parts of a JSON value that `0` reads.
#[derive(Clone, Copy)]
struct JsonSeed<'r>(&'r JsonReads);

impl<'de> DeserializeSeed<'de> for JsonSeed<'_> {
    type Value = Box<dyn Val>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for JsonSeed<'_> {
    type Value = Box<dyn Val>;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(Box::new(CelNull))
    }

    fn visit_bool<E>(self, b: bool) -> Result<Self::Value, E> {
        Ok(Box::new(CelBool::from(b)))
    }

    fn visit_i64<E>(self, i: i64) -> Result<Self::Value, E> {
        Ok(Box::new(CelInt::from(i)))
    }

    fn visit_u64<E>(self, u: u64) -> Result<Self::Value, E> {
        Ok(match i64::try_from(u) {
            Ok(i) => Box::new(CelInt::from(i)),
            Err(_) => Box::new(CelDouble::from(u as f64)),
        })
    }

    fn visit_f64<E>(self, f: f64) -> Result<Self::Value, E> {
        Ok(Box::new(CelDouble::from(f)))
    }

    fn visit_str<E>(self, s: &str) -> Result<Self::Value, E> {
        Ok(Box::new(CelString::from(s.to_owned())))
    }

    fn visit_string<E>(self, s: String) -> Result<Self::Value, E> {
        Ok(Box::new(CelString::from(s)))
    }

    /// A list is read whole: its elements are reached by index or by a comprehension.
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0));
        while let Some(item) = seq.next_element_seed(JsonSeed(&JsonReads::Whole))? {
            items.push(item);
        }
        Ok(Box::new(CelList::from(items)))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut fields = HashMap::new();
        while let Some(key) = map.next_key_seed(FieldSeed(self.0))? {
            match key {
                Some((name, reads)) => {
                    let value = map.next_value_seed(JsonSeed(reads))?;
                    fields.insert(CelMapKey::from(name), value);
                }
                None => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(Box::new(CelMap::from(fields)))
    }
}

/// An object's key: its name and what is read of its value, or `None` when nothing is.
struct FieldSeed<'r>(&'r JsonReads);

impl<'de, 'r> DeserializeSeed<'de> for FieldSeed<'r> {
    type Value = Option<(String, &'r JsonReads)>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_str(self)
    }
}

impl<'r> Visitor<'_> for FieldSeed<'r> {
    type Value = Option<(String, &'r JsonReads)>;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("an object's key")
    }

    fn visit_str<E>(self, name: &str) -> Result<Self::Value, E> {
        Ok(match self.0 {
            JsonReads::Whole => Some((name.to_owned(), &JsonReads::Whole)),
            JsonReads::Fields(fields) => fields.get(name).map(|reads| (name.to_owned(), reads)),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) fn message(topic: &str, payload: &[u8]) -> Message {
        Message {
            content_type: Some("application/json".into()),
            user_properties: vec![("site".into(), "north".into())],
            ..Message::new(topic, bytes::Bytes::copy_from_slice(payload))
        }
    }

    fn expr(source: &str) -> Expression {
        ferry_api::expr::compile(source).unwrap_or_else(|e| panic!("{source}: {e}"))
    }

    #[test]
    fn variables_hold_the_message() {
        let m = message("plant/7/temp", br#"{"device":"d-1","temp":61.5,"n":3}"#);
        let mut s = Scope::new(&m, None, SystemTime::now());
        let checks = [
            "topic == 'plant/7/temp' && levels[1] == '7' && size(levels) == 3",
            "qos == 1 && !retain && properties['site'] == 'north'",
            "contentType == 'application/json' && size(payload) > 10",
            "json.device == 'd-1' && json.temp > 50.0 && json.n == 3 && json.n + 1 == 4",
            "receivedAt > timestamp('2020-01-01T00:00:00Z')",
        ];
        for c in checks {
            assert_eq!(s.filter(&expr(c)), Ok(true), "{c}");
        }
    }

    #[test]
    fn results_are_checked_against_their_field() {
        let m = message("plant/7/temp", br#"{"device":"d-1","temp":61.5}"#);
        let mut s = Scope::new(&m, None, SystemTime::now());
        assert_eq!(
            s.bytes(&expr("json.device"), "key"),
            Ok(Some(b"d-1".to_vec()))
        );
        assert_eq!(s.bytes(&expr("null"), "key"), Ok(None));
        let e = s.bytes(&expr("json.temp"), "key").unwrap_err();
        assert_eq!(e.reason, PermanentReason::Expression);
        assert!(e.message.contains("returned a double"), "{}", e.message);
        let e = s.filter(&expr("json.device")).unwrap_err();
        assert!(e.message.contains("not a bool"), "{}", e.message);
        assert_eq!(
            s.topic(&expr("'readings.' + levels[1]")),
            Ok("readings.7".into())
        );
        let e = s.topic(&expr("'a/b'")).unwrap_err();
        assert!(
            e.message.contains("not a valid Kafka topic name"),
            "{}",
            e.message
        );
        let v = s
            .transform(&expr(
                "{'device': json.device, 'site': levels[1], 't': json.temp}",
            ))
            .unwrap();
        assert_eq!(v, br#"{"device":"d-1","site":"7","t":61.5}"#.to_vec());
    }

    #[test]
    fn a_missing_field_and_a_wrong_type_are_errors_not_panics() {
        let m = message("a", br#"{"a":{"b":"x"}}"#);
        let mut s = Scope::new(&m, None, SystemTime::now());
        let e = s.filter(&expr("json.a.c == 1")).unwrap_err();
        assert_eq!(e.reason, PermanentReason::Expression);
        assert!(e.message.contains("No such key: c"), "{}", e.message);
        assert!(s.filter(&expr("json.a.b + 1 == 2")).is_err());
    }

    #[test]
    fn a_payload_that_is_not_json_fails_only_what_reads_json() {
        let m = message("a/b", b"\x00not json");
        let mut s = Scope::new(&m, None, SystemTime::now());
        let e = s.filter(&expr("json.x == 1")).unwrap_err();
        assert_eq!(e.reason, PermanentReason::InvalidJson);
        assert!(e.message.contains("not JSON"), "{}", e.message);
        assert_eq!(s.filter(&expr("levels[0] == 'a'")), Ok(true));
        let huge = vec![b' '; PAYLOAD_MAX_BYTES + 1];
        let m = message("a", &huge);
        let e = Scope::new(&m, None, SystemTime::now())
            .filter(&expr("has(json.x)"))
            .unwrap_err();
        assert!(e.message.contains("larger than"), "{}", e.message);
    }
}

#[cfg(test)]
mod budget {
    use super::*;

    fn expr(source: &str) -> Expression {
        ferry_api::expr::compile(source).unwrap_or_else(|e| panic!("{source}: {e}"))
    }

    /// A message at the model's worst case: the longest topic, and a payload of the most
    /// elements `json` can hold.
    fn worst_message() -> Message {
        let topic = format!("{}a", "a/".repeat(32_767));
        let items = (PAYLOAD_MAX_BYTES - 64) / 2;
        let payload = format!(r#"{{"n":1,"items":[{}]}}"#, vec!["1"; items].join(","));
        tests::message(&topic, payload.as_bytes())
    }

    /// The runtime budget is the compile-time one, counted in nodes evaluated: an accepted
    /// expression uses no more than its estimate, even on the worst message.
    #[test]
    fn an_accepted_expression_uses_at_most_its_estimate() {
        let m = worst_message();
        for source in [
            "json.items.map(x, x > 0, x * 2).size() > 0",
            "json.items.exists_one(z, z == 4)",
            "levels.all(l, l.matches('^[a-z]+$'))",
            "levels.exists(l, l == 'b') || size(topic) > 0",
            "[0,1,2,3,4,5,6,7,8,9].all(a, [0,1,2,3,4,5,6,7,8,9].all(b, [0,1,2,3,4,5,6,7,8,9].all(c, topic != '')))",
            "{'n': json.n, 'items': json.items, 'site': levels[1]}",
            "'readings.' + levels[1] + '.' + topic",
            "has(json.n) ? json.n + 1 : size(json.items)",
            "{'a': topic + topic, 'b': levels, 'c': [qos, retain]}",
            "json.items.filter(x, x > 0).size() == size(json.items)",
            "[1, 2, 3].map(v, v * qos).size() == 3 && [1, 2].exists(v, v == qos)",
            "levels.map(l, l + l).size() > 0",
        ] {
            let e = expr(source);
            let mut scope = Scope::new(&m, None, SystemTime::now());
            for variable in VARIABLES {
                scope.bind(variable.name);
            }
            let (result, used) =
                cel::budget::with_budget(COST_BUDGET, || e.program().execute(&scope.context));
            assert!(result.is_ok(), "{source}: {result:?}");
            assert!(
                used <= e.cost().steps,
                "{source}: used {used} steps, estimated {}",
                e.cost().steps
            );
        }
    }

    /// One rule's expressions share one budget per message: what the first used is not there
    /// for the next, and the next target starts whole.
    #[test]
    fn a_targets_expressions_share_one_budget_per_message() {
        let m = tests::message("a/b/c", b"{}");
        let e = expr("levels.all(l, l != '') && levels.exists(l, l == 'c')");
        let mut scope = Scope::new(&m, None, SystemTime::now());
        scope.begin_target();
        scope.eval(&e, "filter").expect("within a whole budget");
        let used = scope.steps();
        assert!(used > 3, "{used}");
        // As if the target's earlier expressions had left three steps.
        scope.target_left = 3;
        let error = scope
            .eval(&e, "kafka.key.expression")
            .expect_err("over what is left");
        assert!(
            error.message.contains("together exceeded their budget"),
            "{}",
            error.message
        );
        scope.begin_target();
        scope
            .eval(&e, "filter")
            .expect("the next target has a whole budget");
    }

    /// What the estimate misses stops at the budget, as an error: the nine nested `all` of
    /// issue 21 (10^9 iterations) run unchecked, as if the model had let it through.
    #[test]
    fn an_evaluation_over_budget_stops_as_an_error() {
        let nested = (0..9).fold("topic != ''".to_owned(), |e, i| {
            format!("[0,1,2,3,4,5,6,7,8,9].all(v{i}, {e})")
        });
        let program = ENV.compile(&nested).expect("parses");
        let m = tests::message("a/b", b"{}");
        let mut scope = Scope::new(&m, None, SystemTime::now());
        scope.bind("topic");
        let (result, used) =
            cel::budget::with_budget(COST_BUDGET, || program.execute(&scope.context));
        assert_eq!(result, Err(cel::ExecutionError::CostLimitExceeded));
        assert_eq!(used, COST_BUDGET);
        // Outside a budget nothing is counted, and a budget does not outlive its call.
        let small = ENV.compile("[1, 2].all(x, x > 0)").expect("parses");
        let (result, used) = cel::budget::with_budget(3, || small.execute(&scope.context));
        assert_eq!(result, Err(cel::ExecutionError::CostLimitExceeded));
        assert_eq!(used, 3);
        assert_eq!(small.execute(&scope.context), Ok(Value::Bool(true)));
    }

    #[test]
    fn a_record_larger_than_the_producer_takes_fails_and_keeps_nothing() {
        let big = "x".repeat(200_000);
        let m = tests::message("a/b", format!(r#"{{"s":"{big}"}}"#).as_bytes());
        let mut scope = Scope::new(&m, None, SystemTime::now());
        let five = expr("[json.s, json.s, json.s, json.s, json.s]");
        let rule = |transform: &Expression| ferry_api::RuleExpressions {
            filter: None,
            key: Some(expr("json.s")),
            headers: Vec::new(),
            transform: Some(transform.clone()),
        };
        let out = record(&mut scope, None, &rule(&five), RECORD_MAX_BYTES);
        let error = out.error.expect("too large");
        assert_eq!(error.reason, PermanentReason::Expression);
        assert!(
            error.message.contains("more than the 1000000 bytes"),
            "{}",
            error.message
        );
        assert!(
            out.key.is_none() && out.value.is_none(),
            "what was built is dropped"
        );
        // The same record fits a producer that takes more.
        let out = record(&mut scope, None, &rule(&five), 2_000_000);
        assert!(out.error.is_none(), "{:?}", out.error);
        assert_eq!(
            record_max_bytes(&[("message.max.bytes".to_owned(), "2000000".to_owned())].into()),
            2_000_000
        );
        assert_eq!(record_max_bytes(&Default::default()), RECORD_MAX_BYTES);
    }
}

#[cfg(test)]
mod json_reads {
    use super::*;

    fn reads_of(sources: &[&str]) -> JsonReads {
        let all: Vec<Expression> = sources
            .iter()
            .map(|s| ferry_api::expr::compile(s).unwrap_or_else(|e| panic!("{s}: {e}")))
            .collect();
        JsonReads::union(&all).expect("they read json")
    }

    /// `json` as a Scope built for `sources` holds it, written back as JSON.
    fn held(payload: &[u8], sources: &[&str]) -> Result<serde_json::Value, String> {
        let reads = reads_of(sources);
        let m = tests::message("a", payload);
        let whole = ferry_api::expr::compile("json").map_err(|e| e.to_string())?;
        let value = Scope::new(&m, Some(Arc::new(reads)), SystemTime::now())
            .eval(&whole, "test")
            .map_err(|e| e.message)?;
        value.json().map_err(|e| e.to_string())
    }

    #[test]
    fn json_holds_only_what_the_expressions_read() {
        let payload = br#"{"device":"d","type":"reading","temp":21.5,"filler":"AAAA",
            "r":{"unit":"C","raw":[1,2],"deep":{"x":1}},"items":[{"id":1,"big":"y"}]}"#;
        let got = held(payload, &["json.type != 'heartbeat'", "json.device"]);
        assert_eq!(
            got,
            Ok(serde_json::json!({"device": "d", "type": "reading"}))
        );
        let got = held(
            payload,
            &["json.r.unit == 'C'", "json.items.exists(i, i.id == 1)"],
        );
        assert_eq!(
            got,
            Ok(serde_json::json!({"r": {"unit": "C"}, "items": [{"id": 1, "big": "y"}]}))
        );
        let everything: serde_json::Value = serde_json::from_slice(payload).expect("JSON");
        assert_eq!(
            held(payload, &["json.r.unit", "size(json) > 1"]),
            Ok(everything)
        );
        // A field whose reads go deeper but which is not an object is held whole.
        assert_eq!(
            held(br#"{"r":[1,2],"s":3}"#, &["json.r.unit"]),
            Ok(serde_json::json!({"r": [1, 2]}))
        );
    }

    #[test]
    fn a_payload_that_is_not_json_anywhere_is_refused_even_where_nothing_reads_it() {
        for broken in [
            // Not UTF-8 (a byte string, not a raw one: these are the bytes 0xff 0xfe).
            &b"{\"device\":\"d\",\"filler\":\"\xff\xfe\"}"[..],
            br#"{"device":"d","filler":[1,}"#,
            br#"{"device":"d","filler":"\q"}"#,
            br#"{"device":"d"} trailing"#,
            br#"{"device":"d","deep":"#,
        ] {
            let got = held(broken, &["json.device == 'd'"]);
            assert!(
                got.as_ref().is_err_and(|e| e.contains("not JSON")),
                "{}: {got:?}",
                String::from_utf8_lossy(broken)
            );
        }
    }

    /// Whatever an expression does with `json`, it gets the same answer (or the same error)
    /// from `json` built from what it reads as from `json` built whole.
    #[test]
    fn an_expression_sees_the_same_json_built_from_what_it_reads_as_built_whole() {
        let payloads: [&[u8]; 6] = [
            br#"{"a":{"b":1,"c":[1,2]},"d":"x","e":null,"items":[{"id":1},{"id":2}],"f":{"g":{"h":2.5}}}"#,
            br#"{"a":[1,2],"d":5,"items":[]}"#,
            br#"{"a":"s","f":{"g":7}}"#,
            br#"[1,2,3]"#,
            br#"{"a":{"b":1},"a":{"c":2}}"#,
            br#"{}"#,
        ];
        let expressions = [
            "json.a.b == 1",
            "has(json.a.b)",
            "has(json.a) && has(json.f.g)",
            "'b' in json.a",
            "'a' in json",
            "size(json.a)",
            "json.a == {'b': 1, 'c': [1, 2]}",
            "json['a']['b']",
            "json.a['b'] + 1",
            "json.a.c[1]",
            "json.a.b.c",
            "json.items.exists(i, i.id == 2)",
            "json.items.map(i, i.id)",
            "json.f.g.h * 2.0",
            "json.f",
            "json.d",
            "json.e == null",
            "json[0]",
            "json",
            "type(json.a) == map",
            "[1].map(json, json + 1)",
            "{'x': json.a.b, 'y': json.d, 'z': json.f.g}",
        ];
        for payload in payloads {
            let m = tests::message("a", payload);
            for source in expressions {
                let e =
                    ferry_api::expr::compile(source).unwrap_or_else(|e| panic!("{source}: {e}"));
                let reads = JsonReads::union([&e]).map(Arc::new);
                let now = SystemTime::now();
                let projected = Scope::new(&m, reads, now).eval(&e, "f");
                let whole = Scope::new(&m, None, now).eval(&e, "f");
                assert_eq!(
                    projected,
                    whole,
                    "{source} on {}",
                    String::from_utf8_lossy(payload)
                );
            }
        }
    }

    #[test]
    fn nesting_too_deep_to_build_is_refused_only_where_an_expression_reads() {
        let deep = format!(
            r#"{{"device":"d","x":{}1{}}}"#,
            "[".repeat(200),
            "]".repeat(200)
        );
        assert_eq!(
            held(deep.as_bytes(), &["json.device == 'd'"]),
            Ok(serde_json::json!({"device": "d"}))
        );
        let got = held(deep.as_bytes(), &["size(json.x) == 1"]);
        assert!(
            got.as_ref().is_err_and(|e| e.contains("recursion limit")),
            "{got:?}"
        );
    }
}
