-- wrk script: POST /v1/check over many distinct keys, one chosen at random per request.
-- Requests are formatted once in init() so the load generator spends its core on I/O, not Lua.
-- Env: BENCH_KEYS (default 100000) distinct X-API-Key values (and client IPs).
local reqs = {}
local n = 0

function init(args)
   n = tonumber(os.getenv("BENCH_KEYS") or "100000")
   local headers = { ["Content-Type"] = "application/json" }
   for i = 1, n do
      local body = string.format(
         '{"namespace":"bench","labels":{"app":"orders"},"method":"POST","path":"/orders/%d",' ..
         '"host":"api.example.com","clientIp":"10.%d.%d.%d","headers":{"x-api-key":"key-%d"},"cost":1}',
         i % 100, math.floor(i / 65536) % 256, math.floor(i / 256) % 256, i % 256, i)
      reqs[i] = wrk.format("POST", "/v1/check", headers, body)
   end
   math.randomseed(os.time())
end

function request()
   return reqs[math.random(n)]
end
