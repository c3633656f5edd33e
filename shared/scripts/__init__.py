"""Every Lua script redserve runs, beside the contract it is part of.

The scripts are where the two sides' writes meet atomically, so they belong with the Redis
contract (`shared.keys`, `shared.messages`) rather than inside one caller: the admission
script (an API replica) leaves exactly what the take script (a worker) reads. One module per
script, each holding its Lua, a frozen dataclass for its KEYS and one for its ARGV, and the
parser of its reply into a typed result; callers build and read only those types:

- `admit`: check a tenant's rate limits, queue a request, charge the limits
(api/queue/admission.py);
- `limits`: the rate limits' sections of `admit`, and the settle script
  (api/queue/limits/reservation.py);
- `take`: a worker with room chooses queued requests and claims them (worker/broker/take.py);
- `terminal`: a retried terminal entry, added only if its stream has none
  (worker/broker/publisher.py);
- `request_flag`: set a request's abort key or resumed mark to live no longer than its hash
  (shared/aborts.py, api/endpoints/common.py);
- `handoff`: what `admit` leaves for `take`: one model's queue keys, the group and consumer,
  the entries hash, and the Lua parser of a queued-set member.

`base` turns the dataclasses' field names into KEYS and ARGV positions (the only place that
does) and checks every name the Lua reads against them.
"""
