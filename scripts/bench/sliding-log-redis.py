#!/usr/bin/env python3
"""Redis time of sliding-log decisions with full logs: loads the decision library of a revision
(`HEAD`, any git revision, or `WORK` for the working tree) into the redis-server on PORT under
a name of its own, fills RULES keys with FILL entries each (1 ms apart, limit 1000 per hour,
shadow rules), then makes CALLS decisions and prints Redis's own `usec_per_call` for FCALL.

    redis-server --port 6399 --save '' --appendonly no --daemonize yes
    python3 scripts/bench/sliding-log-redis.py 6399 c8e8e10 && python3 scripts/bench/sliding-log-redis.py 6399 WORK
    RULES=1 CALLS=20000 python3 scripts/bench/sliding-log-redis.py 6399 WORK
    redis-cli -p 6399 shutdown nosave

Run from the checkout; redis-cli must be on PATH.
"""
import hashlib
import os
import subprocess
import sys

port = sys.argv[1]; rev = sys.argv[2]
def show(path):
    if rev == 'WORK': return open(path).read()
    return subprocess.check_output(['git','show',f'{rev}:{path}'], text=True)
code = ''.join(show(f'lua/{f}.lua') for f in ['common','token_bucket','gcra','fixed_window','sliding_window_log','sliding_window_counter','check'])
name = 'bench_' + hashlib.sha256(code.encode()).hexdigest()[:12]
src = f"#!lua name={name}\n{code}\nredis.register_function('{name}', decide)\n"
def cli(*args, inp=None):
    return subprocess.run(['redis-cli','-p',port,*args], input=inp, capture_output=True, text=True).stdout
subprocess.run(['redis-cli','-p',port,'-x','FUNCTION','LOAD','REPLACE'], input=src, capture_output=True, text=True)
def resp(args):
    out = f'*{len(args)}\r\n'
    for a in args:
        a = str(a); out += f'${len(a.encode())}\r\n{a}\r\n'
    return out
rules = int(os.environ.get("RULES", "64"))
keys = [f'{{t}}:{rev}:{i}' for i in range(rules)]
params = '5:1000:3600000000:1000:3600000:-1:0'
def call(now):
    args = ['FCALL', name, rules, *keys, now]
    for _ in range(rules): args += [params, '1']
    return resp(args)
t0 = 1_700_000_000_000_000
pipe = ''.join(call(t0 + i*1000) for i in range(int(os.environ.get("FILL", "1000"))))
subprocess.run(['redis-cli','-p',port,'--pipe'], input=pipe, capture_output=True, text=True)
cli('CONFIG','RESETSTAT')
pipe = ''.join(call(t0 + 1_000_000 + i*1000) for i in range(int(os.environ.get("CALLS", "200"))))
subprocess.run(['redis-cli','-p',port,'--pipe'], input=pipe, capture_output=True, text=True)
stats = cli('INFO','commandstats')
for line in stats.splitlines():
    if line.startswith('cmdstat_fcall'): print(rev, line)
print(rev, 'zcard', cli('ZCARD', keys[0]).strip(), 'memory', cli('MEMORY','USAGE',keys[0]).strip())
