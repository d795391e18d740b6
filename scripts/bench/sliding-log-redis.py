#!/usr/bin/env python3
"""Redis time of sliding-log decisions with full logs: loads the decision library of a revision
(`HEAD`, any git revision, or `WORK` for the working tree) into the redis-server on PORT under
a name of its own, fills RULES keys with FILL entries each (1 ms apart, limit 1000 per hour,
shadow rules), then makes CALLS decisions and prints Redis's own `usec_per_call` for FCALL.

    redis-server --port 6399 --save '' --appendonly no --daemonize yes
    python3 scripts/bench/sliding-log-redis.py 6399 c8e8e10 && python3 scripts/bench/sliding-log-redis.py 6399 WORK
    RULES=1 CALLS=20000 python3 scripts/bench/sliding-log-redis.py 6399 WORK
    redis-cli -p 6399 shutdown nosave

Run from the checkout; redis-cli must be on PATH. The library is the revision's lua/ files in the
order its src/store/redis/library.rs (src/store/redis_library.rs, src/store/redis.rs in older revisions) concatenates
them, called with the arguments its lua/check.lua takes. Every call is checked: a load that
failed, an error reply, or fewer calls than sent ends the script with an error (exit 1) and no
timing, so numbers are never printed for calls that failed.
"""
import hashlib
import os
import re
import subprocess
import sys

port = sys.argv[1]; rev = sys.argv[2]

def fail(message):
    print(f'{rev}: FAILED: {message}', file=sys.stderr)
    sys.exit(1)

def show(path):
    if rev == 'WORK':
        try: return open(path).read()
        except FileNotFoundError: return None
    out = subprocess.run(['git', 'show', f'{rev}:{path}'], capture_output=True, text=True)
    return out.stdout if out.returncode == 0 else None

def library_files():
    for rust in ['src/store/redis/library.rs', 'src/store/redis_library.rs', 'src/store/redis.rs']:
        text = show(rust)
        files = re.findall(r'include_str!\("(?:\.\./)+(lua/[a-z_]+\.lua)"\)', text or '')
        if files: return files
    fail('no include_str!("…/lua/…") in src/store/redis/library.rs (or where older revisions had it)')

code = ''.join(show(f) or fail(f'{f} missing') for f in library_files())
# Since hold ids (concurrency, reservations), `decide` takes the now and a hold id before the
# rules' arguments; before, the now alone.
with_hold = '(2 + 2 * n)' in code
name = 'bench_' + hashlib.sha256(code.encode()).hexdigest()[:12]
src = f"#!lua name={name}\n{code}\nredis.register_function('{name}', decide)\n"
def cli(*args, inp=None):
    out = subprocess.run(['redis-cli', '-p', port, *args], input=inp, capture_output=True, text=True)
    return out.stdout + out.stderr
loaded = cli('-x', 'FUNCTION', 'LOAD', 'REPLACE', inp=src)
if loaded.strip() != name: fail(f'FUNCTION LOAD: {loaded.strip()}')
def resp(args):
    out = f'*{len(args)}\r\n'
    for a in args:
        a = str(a); out += f'${len(a.encode())}\r\n{a}\r\n'
    return out
rules = int(os.environ.get("RULES", "64"))
keys = [f'{{t}}:{rev}:{i}' for i in range(rules)]
params = '5:1000:3600000000:1000:3600000:-1:0'
def call(now):
    args = ['FCALL', name, rules, *keys, now] + ([''] if with_hold else [])
    for _ in range(rules): args += [params, '1']
    return resp(args)
def pipe(calls):
    """Sends the calls through redis-cli --pipe; fails unless every one got a reply, none an error."""
    out = subprocess.run(['redis-cli', '-p', port, '--pipe'], input=''.join(calls), capture_output=True, text=True)
    m = re.search(r'errors: (\d+), replies: (\d+)', out.stdout)
    if out.returncode != 0 or not m or m.group(1) != '0' or int(m.group(2)) != len(calls):
        fail(f'redis-cli --pipe: {(out.stdout + out.stderr).strip().splitlines()[-1:]}: '
             f'first reply: {cli("FCALL", name, str(rules), *keys, "1", *([""] if with_hold else []), *([params, "1"] * rules)).strip()}')
t0 = 1_700_000_000_000_000
pipe([call(t0 + i * 1000) for i in range(int(os.environ.get("FILL", "1000")))])
cli('CONFIG', 'RESETSTAT')
calls = int(os.environ.get("CALLS", "200"))
pipe([call(t0 + 1_000_000 + i * 1000) for i in range(calls)])
stats = cli('INFO', 'commandstats')
fcall = next((l.strip() for l in stats.splitlines() if l.startswith('cmdstat_fcall:')), '')
fields = dict(kv.split('=') for kv in fcall.split(':', 1)[1].split(',')) if fcall else {}
if int(fields.get('calls', 0)) != calls or fields.get('failed_calls', '0') != '0' or fields.get('rejected_calls', '0') != '0':
    fail(f'{calls} calls sent, Redis counted: {fcall or "no FCALL"}')
print(rev, fcall)
print(rev, 'zcard', cli('ZCARD', keys[0]).strip(), 'memory', cli('MEMORY', 'USAGE', keys[0]).strip())
