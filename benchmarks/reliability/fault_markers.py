"""What a client puts in a prompt to set off a fault in the fault-injection server, and the routes that server
adds; light to import (scenarios and tests need these names, not the engine). See fault_injection.py."""

FAULT_INJECTION_LAUNCHER = "benchmarks.reliability.fault_injection"   # ServerProcess(..., launcher=this)
REQUEST_FAULT = "<<inject-request-fault>>"
STEP_FAULT = "<<inject-step-fault>>"
HOLD_FAULT = "<<inject-hold>>"
HOLDS_ROUTE = "/fault-injection/holds"
RELEASE_ROUTE = "/fault-injection/release"
HOLD_TIMEOUT = 60.0   # seconds: a hold nobody ends is released, and counted, so a broken scenario fails, not hangs
