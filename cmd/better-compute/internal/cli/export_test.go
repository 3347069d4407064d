package cli

// ResumePoint exposes resumePoint to the tests.
var ResumePoint = resumePoint
